"""The ways in: the gRPC servicer and the HTTP API beside it, with auth, deadlines, early admission, the drain and the
mapping of failures to status codes. Imports server/models/ and server/engine/, never server/main.py."""
