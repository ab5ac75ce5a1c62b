"""What runs the models: ONNX Runtime sessions, engines, the worker pool, the schedulers, row placement, the source
pool and jobs. Imports runtime/ and model/ only, nothing else of server/."""
