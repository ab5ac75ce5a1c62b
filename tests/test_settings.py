"""nmt-serve settings: every field is a flag and an NMT_ variable; flags win; bad values are named."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from nmt_serve.server.settings import DEFAULT_MODEL_DIR, ServerSettings, env_name, parse_settings


def test_defaults_serve_the_shipped_model() -> None:
    settings = parse_settings([], environ={})
    assert settings == ServerSettings() and settings.model_dir == DEFAULT_MODEL_DIR
    assert (DEFAULT_MODEL_DIR / "manifest.json").is_file()


def test_every_field_reads_its_environment_variable_and_flags_win() -> None:
    environ = {env_name("port"): "6001", env_name("max_texts"): "7", env_name("default_deadline_s"): "2.5",
               env_name("auth_token"): "t", env_name("model_dir"): "/models/x"}  # fmt: skip
    settings = parse_settings(["--max-texts", "9"], environ=environ)
    assert (settings.port, settings.max_texts, settings.default_deadline_s, settings.auth_token) == (6001, 9, 2.5, "t")
    assert settings.model_dir == Path("/models/x")
    assert parse_settings(["/models/y"], environ=environ).model_dir == Path("/models/y")
    for field in dataclasses.fields(ServerSettings):
        assert env_name(field.name).startswith("NMT_")


@pytest.mark.parametrize(("argv", "environ", "named"), [
    (["--max-texts", "0"], {}, "--max-texts must be at least 1, got 0"),
    (["--port", "70000"], {}, "--port must be between 0 and 65535, got 70000"),
    (["--log-level", "LOUD"], {}, "--log-level must be one of DEBUG, INFO, WARNING, ERROR, CRITICAL, got 'LOUD'"),
    (["--grace-s", "-1"], {}, "--grace-s must be at least 0, got -1"),
    (["--tls-cert", "c.pem"], {}, "--tls-cert and --tls-key must be given together"),
    ([], {"NMT_MAX_ROWS": "many"}, "NMT_MAX_ROWS"),
    (["--join-wait-steps", "-1"], {}, "--join-wait-steps must be at least 0, got -1"),
    (["--join-group", "0"], {}, "--join-group must be at least 1, got 0"),
    (["--engines", "-1"], {}, "engines must be at least 0, got -1"),
    ([], {"NMT_THREADS": "-2"}, "threads must be at least 0, got -2"),
    (["--max-rows", "-1"], {}, "--max-rows must be at least 0, got -1"),
    (["--worker-niceness", "20"], {}, "--worker-niceness must be between 0 and 19, got 20"),
    ([], {"NMT_WORKER_NICENESS": "-1"}, "--worker-niceness must be between 0 and 19, got -1"),
    (["--cache-mb", "-1"], {}, "--cache-mb must be at least 0, got -1"),
    (["--native-kernels", "/no/such/libnmt_kernels.so"], {}, "--native-kernels must be 'auto', 'off' or the path of a built library"),
    ([], {"NMT_NATIVE_KERNELS": "on"}, "--native-kernels must be 'auto', 'off' or the path of a built library, got 'on'"),
])  # fmt: skip
def test_bad_settings_are_named(argv: list[str], environ: dict[str, str], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        parse_settings(argv, environ=environ)


def test_help_shows_each_default_and_what_a_special_value_means(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_settings(["--help"], environ={})
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for flag, meaning in (("--engines", "0 = one per core on a CPU"), ("--threads", "0 = the cores shared out"), ("--max-rows", "0 = 32 on a CPU"),
                          ("--port", "0 = any free port"), ("--metrics-port", "-1 = no endpoint"), ("--join-wait-steps", "0 = every step")):  # fmt: skip
        entry = text.split(f"{flag} {flag.lstrip('-').upper().replace('-', '_')} env", 1)[1].split(" --")[0]
        assert meaning in entry, (flag, entry)
    for field in dataclasses.fields(ServerSettings):
        if field.name not in ("model_dir", "more_model_dirs"):  # positional
            assert f"default {field.default!r}" in text, field.name
