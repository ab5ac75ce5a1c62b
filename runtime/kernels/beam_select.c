// Beam search's choice for one request at one step, as a CPython extension (nmt_serve.model._beam_select): what
// BeamSearch.advance_candidates (model/search.py) computes with numpy from the graph's candidates, each row's score
// plus its candidate log-probs with EOS banned while the minimum length is not reached, the 2K best in (score
// descending, token id ascending, row ascending) order, and what `_walk` then picks from them.
//
// Why: that is a dozen numpy calls and a Python loop per request per step, about 12 us of the 19 us a beam-4 request's
// step takes in Python (AMD EPYC Zen 4), and at batch 32 beam 4 the 32 requests' searches were a sixth of a step.
// Here the 4 x 9 candidates of a request are one pass into a sorted list of 2K.
//
// The choice itself is beam_choice.h's, which the compiled steady beam step (beam_step.c) shares.

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#include "beam_choice.h"

// A read-only view of `object` with `ndim` dimensions of items of `size` bytes whose format is one of `formats`.
static int view_of(PyObject* object, Py_buffer* view, int ndim, Py_ssize_t size, const char* formats, const char* name) {
  if (PyObject_GetBuffer(object, view, PyBUF_RECORDS_RO) != 0) return -1;
  const char* format = view->format ? view->format : "B";
  if (format[0] == '<' || format[0] == '=' || format[0] == '@') ++format;
  if (view->ndim != ndim || view->itemsize != size || strlen(format) != 1 || !strchr(formats, format[0])) {
    PyErr_Format(PyExc_ValueError, "%s must be a %d-D array of %zd-byte items (%s), got %d-D of format %s", name, ndim, size,
                 formats, view->ndim, view->format ? view->format : "B");
    PyBuffer_Release(view);
    return -1;
  }
  return 0;
}

static PyObject* choose(PyObject* module, PyObject* args) {
  (void)module;
  PyObject *values_object, *tokens_object, *scores_object;
  Py_ssize_t needed, beam_size, finished;
  long long eos_id;
  int ban_eos;
  if (!PyArg_ParseTuple(args, "OOOnLpnn", &values_object, &tokens_object, &scores_object, &needed, &eos_id, &ban_eos, &beam_size,
                        &finished))
    return NULL;
  Py_buffer values, tokens, scores;
  if (view_of(values_object, &values, 2, 4, "f", "log_probs") != 0) return NULL;
  if (view_of(tokens_object, &tokens, 2, 8, "ql", "token_ids") != 0) {
    PyBuffer_Release(&values);
    return NULL;
  }
  if (view_of(scores_object, &scores, 1, 8, "d", "row_scores") != 0) {
    PyBuffer_Release(&values);
    PyBuffer_Release(&tokens);
    return NULL;
  }
  PyObject* choices = NULL;
  Candidate* best = NULL;
  const Py_ssize_t rows = scores.shape[0];
  if (values.shape[0] != rows || tokens.shape[0] != rows || values.shape[1] < needed || tokens.shape[1] < needed || needed < 1 ||
      beam_size < 1) {
    PyErr_Format(PyExc_ValueError, "need %zd candidates for each of %zd rows and a beam of at least 1", needed, rows);
    goto done;
  }
  const Py_ssize_t count = rows * needed, want = 2 * beam_size < count ? 2 * beam_size : count;
  best = PyMem_Malloc(sizeof(Candidate) * (size_t)(want > 0 ? want : 1));
  if (best == NULL) {
    PyErr_NoMemory();
    goto done;
  }
  const CandidateTable table = {values.buf, tokens.buf, scores.buf, values.strides[0], values.strides[1], tokens.strides[0],
                                 tokens.strides[1], scores.strides[0]};
  const Py_ssize_t filled = best_candidates(&table, rows, needed, eos_id, ban_eos, want, best);
  Py_ssize_t* chosen = (Py_ssize_t*)PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)(filled > 0 ? filled : 1));
  if (chosen == NULL) {
    PyErr_NoMemory();
    goto done;
  }
  const Py_ssize_t taken = walk_candidates(best, filled, eos_id, beam_size, finished, chosen);
  choices = PyList_New(taken);
  for (Py_ssize_t i = 0; choices != NULL && i < taken; ++i) {
    const Candidate* candidate = &best[chosen[i]];
    PyObject* choice = Py_BuildValue("(nLd)", (Py_ssize_t)candidate->row, (long long)candidate->token, candidate->total);
    if (choice == NULL) Py_CLEAR(choices);
    else PyList_SET_ITEM(choices, i, choice);
  }
  PyMem_Free(chosen);
done:
  PyMem_Free(best);
  PyBuffer_Release(&values);
  PyBuffer_Release(&tokens);
  PyBuffer_Release(&scores);
  return choices;
}

static PyMethodDef methods[] = {
    {"choose", choose, METH_VARARGS,
     "choose(log_probs, token_ids, row_scores, needed, eos_id, ban_eos, beam_size, finished) -> [(row, token, total)]: one "
     "request's choices from its rows' best `needed` log-probs (float32) and token ids (int64), best first"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module_definition = {PyModuleDef_HEAD_INIT, "_beam_select",
                                                "Beam search's per-step choice in C (runtime/kernels/beam_select.c).", -1, methods,
                                                NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__beam_select(void) { return PyModule_Create(&module_definition); }
