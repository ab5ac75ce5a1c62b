// A steady greedy step of the engine as a CPython extension (nmt_serve.runtime._greedy_step): the last decoder call's
// rows again, each the one row of a greedy request, fed the token its request chose. What the engine's
// `_arrange_in_place`, StepCache.continue_in_place / run and `advance_greedy_candidates` do for such a step, in one call:
// feed each row its token, number the slots the call writes, run the decoder (the caller's bound run), advance the
// positions, then per request read its row's best two candidates (the graph's TopK), take the first, or the second
// where the first is EOS while `min_output_tokens` bans it, and extend the request's row, score and next token.
//
// Why: at batch 1 greedy the engine's Python around a call took about 40 us of a 390 us step, nearly all of it cold
// code and data after the decoder streamed the weights through the caches; a compiled step touches a few cache lines.
//
// Same results: the same stores into the same buffers and the same choice, score (the float32 log-prob added to the
// float64 score) and tuple of tokens as the Python path (tests/test_greedy_step.py holds them equal). A request whose
// token ends it (EOS, or its length reached) is left as it was and reported: the engine finishes it in Python.

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#include "token_tuple.h"

// A C-contiguous view of `object` of `itemsize`-byte items (writable where asked); `name` goes into the error.
static int view_of(PyObject* object, Py_buffer* view, Py_ssize_t itemsize, int writable, const char* name) {
  if (PyObject_GetBuffer(object, view, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) != 0) return -1;
  if (view->itemsize != itemsize) {
    PyErr_Format(PyExc_ValueError, "%s must hold %zd-byte items, got %zd", name, itemsize, view->itemsize);
    PyBuffer_Release(view);
    return -1;
  }
  return 0;
}

// One request's search state: its searcher's lists (rows: one tuple of tokens, scores: one float, next tokens: one
// int), the fewest tokens before EOS may end it, the most tokens it may have, and EOS.
typedef struct {
  PyObject *rows, *scores, *next_tokens;
  Py_ssize_t min_tokens, max_length;
  long long eos;
} Request;

static int request_of(PyObject* item, Request* request, Py_ssize_t index) {
  if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 6) {
    PyErr_Format(PyExc_TypeError, "request %zd must be a tuple (rows, scores, next tokens, min tokens, max length, eos)", index);
    return -1;
  }
  request->rows = PyTuple_GET_ITEM(item, 0), request->scores = PyTuple_GET_ITEM(item, 1);
  request->next_tokens = PyTuple_GET_ITEM(item, 2);
  if (!PyList_Check(request->rows) || PyList_GET_SIZE(request->rows) != 1 || !PyTuple_Check(PyList_GET_ITEM(request->rows, 0)) ||
      !PyList_Check(request->scores) || PyList_GET_SIZE(request->scores) != 1 || !PyList_Check(request->next_tokens) ||
      PyList_GET_SIZE(request->next_tokens) != 1) {
    PyErr_Format(PyExc_ValueError, "request %zd: rows, scores and next tokens must be lists of one live row", index);
    return -1;
  }
  request->min_tokens = PyLong_AsSsize_t(PyTuple_GET_ITEM(item, 3));
  request->max_length = PyLong_AsSsize_t(PyTuple_GET_ITEM(item, 4));
  request->eos = PyLong_AsLongLong(PyTuple_GET_ITEM(item, 5));
  return PyErr_Occurred() ? -1 : 0;
}

typedef struct {
  Py_buffer tgt_ids, positions, slot_ids, values, ids;
  int held;  // how many of the views above are held, in that order
} Buffers;

static void release(Buffers* buffers) {
  Py_buffer* views[] = {&buffers->tgt_ids, &buffers->positions, &buffers->slot_ids, &buffers->values, &buffers->ids};
  for (int i = 0; i < buffers->held; ++i) PyBuffer_Release(views[i]);
}

// After the run: each request's choice from its candidate row (request i's is candidate row i, whichever row of the
// call it has). Continuing requests are extended in place; the rest are returned.
static PyObject* advance(const Request* requests, Py_ssize_t rows, const float* values, const int64_t* ids, Py_ssize_t stride) {
  PyObject* ending = PyList_New(0);
  if (ending == NULL) return NULL;
  for (Py_ssize_t row = 0; row < rows; ++row) {  // `row`: the request's index, its candidate row
    const Request* request = &requests[row];
    PyObject* tokens = PyList_GET_ITEM(request->rows, 0);
    const Py_ssize_t length = PyTuple_GET_SIZE(tokens);
    Py_ssize_t first = row * stride;
    if (ids[first] == request->eos && length < request->min_tokens) ++first;  // EOS banned: the best of the rest
    const long long token = (long long)ids[first];
    const double score = PyFloat_AsDouble(PyList_GET_ITEM(request->scores, 0)) + (double)values[first];
    if (token == request->eos || length + 1 >= request->max_length) {
      PyObject* end = Py_BuildValue("(nLd)", row, token, score);
      if (end == NULL || PyList_Append(ending, end) != 0) {
        Py_XDECREF(end);
        Py_DECREF(ending);
        return NULL;
      }
      Py_DECREF(end);
      continue;
    }
    PyObject* longer = extended(tokens, token);
    PyObject* new_score = PyFloat_FromDouble(score);
    PyObject* next = PyLong_FromLongLong(token);
    if (longer == NULL || new_score == NULL || next == NULL) {
      Py_XDECREF(longer);
      Py_XDECREF(new_score);
      Py_XDECREF(next);
      Py_DECREF(ending);
      return NULL;
    }
    PyList_SetItem(request->rows, 0, longer);  // each steals its reference and drops the old item's
    PyList_SetItem(request->scores, 0, new_score);
    PyList_SetItem(request->next_tokens, 0, next);
  }
  return ending;
}

static PyObject* step(PyObject* module, PyObject* args) {
  (void)module;
  PyObject *run, *binding, *tgt_object, *positions_object, *slot_ids_object, *values_object, *ids_object, *request_list, *row_list;
  long long first_id;
  Py_ssize_t stride;
  if (!PyArg_ParseTuple(args, "OOOOOLOOnO!O!", &run, &binding, &tgt_object, &positions_object, &slot_ids_object, &first_id,
                        &values_object, &ids_object, &stride, &PyList_Type, &request_list, &PyList_Type, &row_list))
    return NULL;
  const Py_ssize_t rows = PyList_GET_SIZE(request_list);
  if (PyList_GET_SIZE(row_list) != rows) {
    PyErr_SetString(PyExc_ValueError, "requests and their rows must be lists of one length");
    return NULL;
  }
  // Per request its row, then per row whether a request has it: each row of the call is one request's.
  Request* requests = PyMem_Malloc((size_t)(rows > 0 ? rows : 1) * (sizeof(Request) + sizeof(Py_ssize_t) + 1));
  if (requests == NULL) return PyErr_NoMemory();
  Py_ssize_t* row_of = (Py_ssize_t*)(requests + (rows > 0 ? rows : 1));
  char* taken = (char*)(row_of + (rows > 0 ? rows : 1));
  memset(taken, 0, (size_t)(rows > 0 ? rows : 1));
  Buffers buffers = {.held = 0};
  PyObject* result = NULL;
  for (Py_ssize_t index = 0; index < rows; ++index) {
    if (request_of(PyList_GET_ITEM(request_list, index), &requests[index], index) != 0) goto done;
    row_of[index] = PyLong_AsSsize_t(PyList_GET_ITEM(row_list, index));
    if (PyErr_Occurred()) goto done;
    if (row_of[index] < 0 || row_of[index] >= rows || taken[row_of[index]]) {
      PyErr_Format(PyExc_ValueError, "request %zd's row %zd: the rows must be 0 to %zd, one per request", index, row_of[index], rows - 1);
      goto done;
    }
    taken[row_of[index]] = 1;
  }
  if (view_of(tgt_object, &buffers.tgt_ids, 8, 1, "the fed tokens") != 0) goto done;
  buffers.held = 1;
  if (view_of(positions_object, &buffers.positions, 8, 1, "the positions") != 0) goto done;
  buffers.held = 2;
  if (view_of(slot_ids_object, &buffers.slot_ids, 8, 1, "the slot ids") != 0) goto done;
  buffers.held = 3;
  if (view_of(values_object, &buffers.values, 4, 0, "the candidate log-probs") != 0) goto done;
  buffers.held = 4;
  if (view_of(ids_object, &buffers.ids, 8, 0, "the candidate ids") != 0) goto done;
  buffers.held = 5;
  const Py_ssize_t capacity = buffers.slot_ids.ndim == 2 ? buffers.slot_ids.shape[1] : 0;
  if (buffers.slot_ids.ndim != 2 || buffers.slot_ids.shape[0] < rows || buffers.tgt_ids.len / 8 < rows ||
      buffers.positions.len / 8 < rows || stride < 2 || buffers.values.len / 4 < rows * stride || buffers.ids.len / 8 < rows * stride) {
    PyErr_SetString(PyExc_ValueError, "the buffers must hold every row (slot ids 2-D) and two or more candidates per row");
    goto done;
  }
  int64_t* tgt_ids = buffers.tgt_ids.buf;
  int64_t* positions = buffers.positions.buf;
  int64_t* slot_ids = buffers.slot_ids.buf;
  for (Py_ssize_t row = 0; row < rows; ++row)
    if (positions[row] < 0 || positions[row] >= capacity) {
      PyErr_Format(PyExc_ValueError, "row %zd is at position %lld, outside the cache's %zd slots", row, (long long)positions[row], capacity);
      goto done;
    }
  for (Py_ssize_t index = 0; index < rows; ++index) {
    tgt_ids[row_of[index]] = PyLong_AsLongLong(PyList_GET_ITEM(requests[index].next_tokens, 0));
    if (PyErr_Occurred()) goto done;
  }
  // Numbered before the run, as StepCache.run does: a failed run may have written the slots.
  for (Py_ssize_t row = 0; row < rows; ++row) slot_ids[row * capacity + positions[row]] = first_id + row;
  PyObject* ran = PyObject_CallOneArg(run, binding);
  if (ran == NULL) goto done;
  Py_DECREF(ran);
  for (Py_ssize_t row = 0; row < rows; ++row) ++positions[row];
  result = advance(requests, rows, buffers.values.buf, buffers.ids.buf, stride);
done:
  release(&buffers);
  PyMem_Free(requests);
  return result;
}

static PyMethodDef methods[] = {
    {"step", step, METH_VARARGS,
     "step(run, binding, tgt_ids, positions, slot_ids, first_id, candidate_log_probs, candidate_ids, stride, requests, rows) -> "
     "[(request, token, score)] of the requests this step ends: one steady greedy step (module comment); requests: per "
     "request (rows, scores, next tokens, min output tokens, max length, eos) of its searcher, in candidate-row order; "
     "rows: per request the row of the call it has"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module_definition = {PyModuleDef_HEAD_INIT, "_greedy_step",
                                                "A steady greedy step in C (runtime/kernels/greedy_step.c).", -1, methods,
                                                NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__greedy_step(void) { return PyModule_Create(&module_definition); }
