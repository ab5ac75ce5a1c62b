// The page's only script: models and beam limits from GET /v1/models, translation from POST /v1/translate/stream (SSE).
"use strict";

const $ = (id) => document.getElementById(id);
let limits = {};  // model name -> its limits (beam choices)

function headers() {
  const token = $("token").value.trim();
  return token ? { "Content-Type": "application/json", "Authorization": "Bearer " + token } : { "Content-Type": "application/json" };
}

function showError(message) {
  $("error").textContent = message;
  $("error").hidden = !message;
}

// An error answer of the API ({"error": {"code", "message"}}) in words.
async function errorOf(response) {
  try {
    const body = await response.json();
    return `${body.error.message} (${body.error.code}, HTTP ${response.status})`;
  } catch (_) {
    return `the server answered HTTP ${response.status}`;
  }
}

function fillBeams() {
  const max = (limits[$("model").value] || {}).max_beam_size || 1;
  const chosen = Number($("beam").value) || 1;
  $("beam").replaceChildren(...Array.from({ length: max }, (_, i) => new Option(String(i + 1), String(i + 1))));
  $("beam").value = String(Math.min(chosen, max));
}

async function loadModels() {
  const response = await fetch("/v1/models", { headers: headers() });
  if (!response.ok) {
    showError("Cannot list the models: " + await errorOf(response));
    return;
  }
  const body = await response.json();
  limits = Object.fromEntries(body.models.map((model) => [model.name, model.limits]));
  $("model").replaceChildren(...body.models.map((model) => new Option(`${model.name} (${model.version}, ${model.precision})`, model.name)));
  $("model").value = body.default_model;
  fillBeams();
  showError("");
}

// Server-sent events off a fetch body: blocks separated by a blank line, each "event:" and "data:" lines.
async function* events(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const fields = Object.fromEntries(block.split("\n").map((line) => [line.slice(0, line.indexOf(": ")), line.slice(line.indexOf(": ") + 2)]));
      yield { name: fields.event || "", data: JSON.parse(fields.data) };
    }
  }
}

async function translate(event) {
  event.preventDefault();
  $("target").textContent = "";
  $("preview").hidden = true;
  $("status").textContent = "";
  delete document.body.dataset.done;
  showError("");
  $("translate").disabled = true;
  const started = performance.now();
  const format = $("format").value;
  const request = { text: $("source").value, model: $("model").value, options: { beam_size: Number($("beam").value), format } };
  try {
    const response = await fetch("/v1/translate/stream", { method: "POST", headers: headers(), body: JSON.stringify(request) });
    if (!response.ok) {
      showError(await errorOf(response));
      return;
    }
    for await (const { name, data } of events(response)) {
      if (name === "error") {
        showError(`${data.error.message} (${data.error.code})`);
        return;
      }
      $("target").textContent += data.text_delta;
      if (data.final) {
        $("target").textContent = data.hypotheses[0].text;  // HTML too: its markup shown as text, never parsed here
        if (format === "html") {
          // Rendered only in a frame with every sandbox restriction on: no scripts, no forms, no same origin.
          $("preview").srcdoc = data.hypotheses[0].text;
          $("preview").hidden = false;
        }
        $("status").textContent = `${data.hypotheses[0].token_count} tokens in ${Math.round(performance.now() - started)} ms`;
        document.body.dataset.done = "true";
      }
    }
  } catch (error) {
    showError("The server could not be reached: " + error.message);
  } finally {
    $("translate").disabled = false;
  }
}

$("form").addEventListener("submit", translate);
$("model").addEventListener("change", fillBeams);
$("token").addEventListener("change", loadModels);
loadModels();
