"""The models one server serves: the registry, each served model, request reading and the metrics (per model, and
the access log that every finished call writes). Imports server/engine/, never server/api/."""
