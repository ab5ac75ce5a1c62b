"""The torch-free pieces the server runs on: model-dir loading and verification, the ONNX Runtime step, the step cache,
the source layout and the host self-check. export/ writes model dirs; server/ reads them through this package."""
