// The token tuples a compiled step extends (greedy_step.c, beam_step.c): Python tuples of ints, as model/search.py
// keeps each row's generated tokens.

#ifndef NMT_TOKEN_TUPLE_H
#define NMT_TOKEN_TUPLE_H

#include <Python.h>

// The row's tokens with `token` appended: a new tuple, as `tokens + (token,)` makes.
static PyObject* extended(PyObject* tokens, long long token) {
  const Py_ssize_t length = PyTuple_GET_SIZE(tokens);
  PyObject* longer = PyTuple_New(length + 1);
  if (longer == NULL) return NULL;
  for (Py_ssize_t i = 0; i < length; ++i) {
    PyObject* item = PyTuple_GET_ITEM(tokens, i);
    Py_INCREF(item);
    PyTuple_SET_ITEM(longer, i, item);
  }
  PyObject* last = PyLong_FromLongLong(token);
  if (last == NULL) {
    Py_DECREF(longer);
    return NULL;
  }
  PyTuple_SET_ITEM(longer, length, last);
  return longer;
}

#endif
