// The calling thread's floating-point mode as a CPython extension (nmt_serve.runtime._float_mode): the engine flushes
// denormal floats to zero around its ONNX Runtime calls (server/engine/engine.py), then puts the mode back.
//
// Why: a log-softmax over a row whose logits span more than ~87 computes exponentials below float's normal range, and
// each such product or sum takes a microcode assist on x86: ONNX Runtime's LogSoftmax over 128 rows of 58,101 logits
// spread like an untrained OPUS-MT-sized model's took 43.5 ms, and 10.2 ms with denormals flushed, its output bit for
// bit the same (a term below 1e-38 changes no float sum that holds the row's largest term, 1). ONNX Runtime's own
// session option (session.set_denormal_as_zero) sets its pool threads and, for good, the thread that makes the
// session, not a thread that only runs it, as the engine's worker does (runtime/float_mode.py imports this module for
// the engine and for the session's maker, which puts its thread's mode back).
//
// Only the SSE control register (MXCSR: flush-to-zero, bit 15, and denormals-are-zero, bit 6); elsewhere the calls do
// nothing.

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#define HAS_MXCSR 1
#else
#define HAS_MXCSR 0
#endif

static const unsigned int kFlushBits = 0x8040;  // FTZ | DAZ

static PyObject* flush_denormals(PyObject* module, PyObject* unused) {
  (void)module;
  (void)unused;
#if HAS_MXCSR
  const unsigned int mode = _mm_getcsr();
  _mm_setcsr(mode | kFlushBits);
  return PyLong_FromUnsignedLong(mode);
#else
  return PyLong_FromLong(-1);
#endif
}

static PyObject* restore(PyObject* module, PyObject* argument) {
  (void)module;
  const long mode = PyLong_AsLong(argument);
  if (mode == -1 && PyErr_Occurred()) return NULL;
#if HAS_MXCSR
  if (mode < 0 || mode > 0xFFFF) {
    PyErr_SetString(PyExc_ValueError, "restore takes the mode flush_denormals returned");
    return NULL;
  }
  _mm_setcsr((unsigned int)mode);
#endif
  Py_RETURN_NONE;
}

static PyObject* mode(PyObject* module, PyObject* unused) {
  (void)module;
  (void)unused;
#if HAS_MXCSR
  return PyLong_FromUnsignedLong(_mm_getcsr());
#else
  return PyLong_FromLong(-1);
#endif
}

static PyMethodDef methods[] = {
    {"flush_denormals", flush_denormals, METH_NOARGS,
     "flush_denormals() -> the thread's mode before: from now on this thread flushes denormal floats to zero"},
    {"restore", restore, METH_O, "restore(mode): put back the mode flush_denormals returned"},
    {"mode", mode, METH_NOARGS, "mode() -> the thread's floating-point control word (MXCSR), -1 where there is none"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module_definition = {PyModuleDef_HEAD_INIT, "_float_mode",
                                               "The calling thread's denormal handling (runtime/kernels/float_mode.c).", -1, methods,
                                               NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__float_mode(void) { return PyModule_Create(&module_definition); }
