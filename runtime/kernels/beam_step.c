// A steady beam step of the engine as a CPython extension (nmt_serve.runtime._beam_step): the same beam requests as the
// last decoder call, each keeping its places, none joining or leaving. What the engine's `_row_inputs`, StepCache.arrange /
// run and BeamSearch.advance_candidates do for such a step, in one call:
//   1. lay out each request's rows: a row continuing a place no earlier row of the request took stays there, the others
//      take the request's places no row continues, in the order the request held them (server/engine/row_placement.py);
//      a row in a new place takes its parent's cached slots from the first slot whose lineage differs
//      (cache_moves.c's copy_rows) and its position; each row is fed its token and is a candidate row;
//   2. number the slots the call writes, run the decoder (the caller's bound run), advance the positions;
//   3. per request, choose from its candidate rows (beam_choice.h) and, where no choice ends a hypothesis (EOS, or the
//      length reached) and the beam keeps its width, extend its rows, scores and next tokens in place. The others are
//      returned with their choices: the engine extends them in Python (BeamSearch.take_choices) and finishes those done.
//
// Why: at batch 1 beam 4 the engine's Python around a call took about 100 us of a 600 us step (Intel Xeon, AMX),
// nearly all of it cold code and data after the decoder streamed the weights through the caches.
//
// Same results: the same places, copies, stores and choices as the Python path (tests/test_beam_step.py holds them
// equal, alone and through the engine).

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#include "token_tuple.h"

#include "beam_choice.h"

// A C-contiguous view of `object` with `ndim` dimensions (0: any) of `itemsize`-byte items (0: any); `name` goes into
// the error.
static int view_of(PyObject* object, Py_buffer* view, int ndim, Py_ssize_t itemsize, int writable, const char* name) {
  if (PyObject_GetBuffer(object, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0)) != 0) return -1;
  if ((ndim && view->ndim != ndim) || (itemsize && view->itemsize != itemsize)) {
    PyErr_Format(PyExc_ValueError, "%s must be %d-D with %zd-byte items, got %d-D with %zd-byte items", name, ndim, itemsize,
                 view->ndim, view->itemsize);
    PyBuffer_Release(view);
    return -1;
  }
  return 0;
}

// One request: the engine's lists for it (its rows' places in the last call, the local parents its rows continue), its
// searcher's (rows' tokens, scores, next tokens, finished hypotheses) and options; `first` is its first row among the
// call's rows in request order (its first candidate row), `length` its rows' tokens so far.
typedef struct {
  PyObject *row_ids, *parents, *rows, *scores, *next_tokens, *finished;
  Py_ssize_t beam_size, min_tokens, max_length, width, first, length, needed;
  long long eos;
} Request;

static int is_list_of(PyObject* list, Py_ssize_t length) { return PyList_Check(list) && PyList_GET_SIZE(list) == length; }

static int request_of(PyObject* item, Request* request, Py_ssize_t index) {
  if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 10) {
    PyErr_Format(PyExc_TypeError, "request %zd must be a tuple (row ids, local parents, rows, scores, next tokens, finished, "
                 "beam size, min tokens, max length, eos)", index);
    return -1;
  }
  PyObject** items = &PyTuple_GET_ITEM(item, 0);
  request->row_ids = items[0], request->parents = items[1], request->rows = items[2], request->scores = items[3];
  request->next_tokens = items[4], request->finished = items[5];
  request->width = PyList_Check(request->row_ids) ? PyList_GET_SIZE(request->row_ids) : 0;
  const Py_ssize_t width = request->width;
  if (width < 1 || !is_list_of(request->parents, width) || !is_list_of(request->rows, width) || !is_list_of(request->scores, width) ||
      !is_list_of(request->next_tokens, width) || !PyList_Check(request->finished)) {
    PyErr_Format(PyExc_ValueError, "request %zd: row ids, local parents, rows, scores and next tokens must be lists of its "
                 "rows (one length, at least 1), finished a list", index);
    return -1;
  }
  request->beam_size = PyLong_AsSsize_t(items[6]);
  request->min_tokens = PyLong_AsSsize_t(items[7]);
  request->max_length = PyLong_AsSsize_t(items[8]);
  request->eos = PyLong_AsLongLong(items[9]);
  if (PyErr_Occurred()) return -1;
  if (request->beam_size < 1) {
    PyErr_Format(PyExc_ValueError, "request %zd: a beam of at least 1", index);
    return -1;
  }
  PyObject* tokens = PyList_GET_ITEM(request->rows, 0);
  if (!PyTuple_Check(tokens)) {
    PyErr_Format(PyExc_TypeError, "request %zd: its rows must be tuples of tokens", index);
    return -1;
  }
  request->length = PyTuple_GET_SIZE(tokens);
  request->needed = 2 * request->beam_size + (request->length < request->min_tokens);  // BeamSearch.candidates_needed
  return 0;
}

// Item `index` of a list of ints, or -1 with an error set.
static Py_ssize_t item(PyObject* list, Py_ssize_t index) { return PyNumber_AsSsize_t(PyList_GET_ITEM(list, index), PyExc_OverflowError); }

typedef struct {
  Py_buffer block, slot_ids, tgt_ids, positions, candidate_rows, values, ids;
  int held;  // how many of the views above are held, in that order
} Buffers;

// The views in the order they are held.
static void list_views(Buffers* buffers, Py_buffer** views) {
  Py_buffer* all[] = {&buffers->block,          &buffers->slot_ids, &buffers->tgt_ids, &buffers->positions,
                      &buffers->candidate_rows, &buffers->values,   &buffers->ids};
  memcpy(views, all, sizeof(all));
}

static void release(Buffers* buffers) {
  Py_buffer* views[7];
  list_views(buffers, views);
  for (int i = 0; i < buffers->held; ++i) PyBuffer_Release(views[i]);
}

static int hold(Buffers* buffers, PyObject* const* objects) {
  Py_buffer* views[7];
  list_views(buffers, views);
  static const int ndims[] = {5, 2, 0, 0, 0, 0, 0};
  static const Py_ssize_t sizes[] = {0, 8, 8, 8, 8, 4, 8};  // the cache: int8 or float32
  static const char* names[] = {"the cache block (tensors, rows, heads, length, head dim)", "the slot ids", "the fed tokens",
                                "the positions", "the candidate rows", "the candidate log-probs", "the candidate ids"};
  for (int i = 0; i < 7; ++i) {
    if (view_of(objects[i], views[i], ndims[i], sizes[i], i < 5, names[i]) != 0) return -1;
    buffers->held = i + 1;
  }
  return 0;
}

// A row's place moves: it takes `from`'s slots [first differing, end) of every (tensor, head) and their lineage.
static Py_ssize_t copy_row(const Py_buffer* block, int64_t* lineage, Py_ssize_t lineage_stride, Py_ssize_t row, Py_ssize_t from,
                           Py_ssize_t end) {
  const int64_t *have = lineage + row * lineage_stride, *want = lineage + from * lineage_stride;
  Py_ssize_t first = 0;
  while (first < end && want[first] != 0 && have[first] == want[first]) ++first;  // 0: never proven equal
  if (first >= end) return 0;
  const Py_ssize_t tensors = block->shape[0], rows = block->shape[1], heads = block->shape[2], capacity = block->shape[3];
  const Py_ssize_t slot_bytes = block->shape[4] * block->itemsize;
  const size_t bytes = (size_t)((end - first) * slot_bytes);
  for (Py_ssize_t tensor = 0; tensor < tensors; ++tensor)
    for (Py_ssize_t head = 0; head < heads; ++head) {
      char* base = (char*)block->buf + (tensor * rows * heads + head) * capacity * slot_bytes + first * slot_bytes;
      memcpy(base + row * heads * capacity * slot_bytes, base + from * heads * capacity * slot_bytes, bytes);
    }
  memcpy(lineage + row * lineage_stride + first, lineage + from * lineage_stride + first, (size_t)(end - first) * sizeof(int64_t));
  return end - first;
}

// Step 1 for every request: places, moves, tokens and candidate rows. Scratch: `place`, `origin`, `scratch` and `tokens`
// with room for every row, `taken` two bytes per row. Returns the slots copied, or -1 with an error set (before anything was
// written, but for a failed conversion of a new place to a Python int).
static Py_ssize_t lay_out(Request* requests, Py_ssize_t count, Py_ssize_t rows, Py_ssize_t stride, const Buffers* buffers,
                          Py_ssize_t* place, Py_ssize_t* origin, Py_ssize_t* scratch, int64_t* tokens, char* taken) {
  // Check and read everything first: nothing is written unless the whole layout is valid.
  char* held_place = taken + rows;  // per place of the call: whether a request holds it
  memset(taken, 0, (size_t)(2 * rows));
  const Py_ssize_t capacity = buffers->block.shape[3];
  int64_t* positions = buffers->positions.buf;
  for (Py_ssize_t index = 0; index < count; ++index) {
    const Request* request = &requests[index];
    if (request->needed > stride) {
      PyErr_Format(PyExc_ValueError, "request %zd needs %zd candidates per row; the call has %zd", index, request->needed, stride);
      return -1;
    }
    for (Py_ssize_t i = 0; i < request->width; ++i) {
      const Py_ssize_t held = item(request->row_ids, i), parent = item(request->parents, i);
      tokens[request->first + i] = PyLong_AsLongLong(PyList_GET_ITEM(request->next_tokens, i));
      if (PyErr_Occurred()) return -1;
      if (held < 0 || held >= rows || held_place[held] || parent < 0 || parent >= request->width) {
        PyErr_Format(PyExc_ValueError, "request %zd row %zd: place %zd, parent %zd: each of the %zd places must be held once, "
                     "each parent one of the request's rows", index, i, held, parent, rows);
        return -1;
      }
      held_place[held] = 1;
      place[request->first + i] = held;  // for now: the places it held, which the parents below name
      origin[request->first + i] = parent;
    }
  }
  for (Py_ssize_t row = 0; row < rows; ++row)
    if (positions[row] < 0 || positions[row] >= capacity) {
      PyErr_Format(PyExc_ValueError, "row %zd is at position %lld, outside the cache's %zd slots", row, (long long)positions[row],
                   capacity);
      return -1;
    }
  Py_ssize_t copied = 0;
  int64_t* fed = buffers->tgt_ids.buf;
  int64_t* lineage = buffers->slot_ids.buf;
  int64_t* candidate_rows = buffers->candidate_rows.buf;
  for (Py_ssize_t index = 0; index < count; ++index) {
    const Request* request = &requests[index];
    const Py_ssize_t first = request->first, width = request->width;
    Py_ssize_t* held = place + first;  // the places held, in the request's order; then the rows' new places
    Py_ssize_t* continued = origin + first;
    Py_ssize_t* free_places = scratch + first;
    for (Py_ssize_t i = 0; i < width; ++i) continued[i] = held[continued[i]];  // local parent -> its place
    // A row continuing a place no earlier row took stays there; the others take the places no row stays in, in the
    // order the request held them (collected before `held` is overwritten).
    Py_ssize_t free_count = 0, next_free = 0;
    for (Py_ssize_t i = 0; i < width; ++i) taken[continued[i]] = 1;
    for (Py_ssize_t i = 0; i < width; ++i)
      if (!taken[held[i]]) free_places[free_count++] = held[i];
    for (Py_ssize_t i = 0; i < width; ++i) {
      if (taken[continued[i]] == 1) {
        held[i] = continued[i];
        taken[continued[i]] = 2;  // kept by its first continuing row
      } else {
        held[i] = free_places[next_free++];
      }
    }
    for (Py_ssize_t i = 0; i < width; ++i) {
      const Py_ssize_t row = held[i], from = continued[i];
      if (row != from) {  // a place no row continues: no copy reads it
        copied += copy_row(&buffers->block, lineage, buffers->slot_ids.shape[1], row, from, positions[from]);
        positions[row] = positions[from];
      }
      fed[row] = tokens[first + i];
      candidate_rows[first + i] = row;
    }
  }
  for (Py_ssize_t index = 0; index < count; ++index)  // the engine's record of each request's places (Job.row_ids)
    for (Py_ssize_t i = 0; i < requests[index].width; ++i) {
      PyObject* row = PyLong_FromSsize_t(place[requests[index].first + i]);
      if (row == NULL) return -1;
      PyList_SetItem(requests[index].row_ids, i, row);
    }
  return copied;
}

// Sets item i of `list` to a new reference per i from `items` (stolen); on a NULL item drops the rest and fails.
static int set_items(PyObject* list, PyObject** items, Py_ssize_t count) {
  int failed = 0;
  for (Py_ssize_t i = 0; i < count; ++i) {
    if (items[i] == NULL || failed) {
      Py_XDECREF(items[i]);
      failed = 1;
      continue;
    }
    PyList_SetItem(list, i, items[i]);
  }
  return failed ? -1 : 0;
}

// Extends a request whose choices end nothing (all live, as many as its rows) in place, as BeamSearch._extend would.
static int extend_in_place(const Request* request, const Candidate* best, const Py_ssize_t* chosen, PyObject** scratch) {
  const Py_ssize_t width = request->width;
  PyObject **rows = scratch, **scores = scratch + width, **tokens = scratch + 2 * width, **parents = scratch + 3 * width;
  for (Py_ssize_t i = 0; i < width; ++i) {
    const Candidate* choice = &best[chosen[i]];
    rows[i] = extended(PyList_GET_ITEM(request->rows, choice->row), (long long)choice->token);
    scores[i] = PyFloat_FromDouble(choice->total);
    tokens[i] = PyLong_FromLongLong((long long)choice->token);
    parents[i] = PyLong_FromSsize_t((Py_ssize_t)choice->row);
  }
  // Every new item is made before any is stored: the new rows read the old ones.
  int failed = set_items(request->rows, rows, width);
  failed |= set_items(request->scores, scores, width);
  failed |= set_items(request->next_tokens, tokens, width);
  failed |= set_items(request->parents, parents, width);
  return failed ? -1 : 0;
}

// Step 3 for one request: its choice; extended in place, or appended to `handed` as (index, [(row, token, total)]).
static int advance(const Request* request, Py_ssize_t index, const Buffers* buffers, Py_ssize_t stride, double* row_scores,
                   Candidate* best, Py_ssize_t* chosen, PyObject** scratch, PyObject* handed) {
  const Py_ssize_t width = request->width;
  for (Py_ssize_t i = 0; i < width; ++i) {
    row_scores[i] = PyFloat_AsDouble(PyList_GET_ITEM(request->scores, i));
    if (row_scores[i] == -1.0 && PyErr_Occurred()) return -1;
  }
  const Py_ssize_t first = request->first * stride;
  const CandidateTable table = {(const char*)buffers->values.buf + first * 4, (const char*)buffers->ids.buf + first * 8,
                                (const char*)row_scores, stride * 4, 4, stride * 8, 8, sizeof(double)};
  const Py_ssize_t count = width * request->needed;
  const Py_ssize_t want = 2 * request->beam_size < count ? 2 * request->beam_size : count;
  const Py_ssize_t filled = best_candidates(&table, width, request->needed, request->eos, request->length < request->min_tokens,
                                            want, best);
  const Py_ssize_t taken = walk_candidates(best, filled, request->eos, request->beam_size, PyList_GET_SIZE(request->finished), chosen);
  // An EOS choice also makes more choices than rows where the request has a row per beam; checked on its own all the same.
  int ends = taken != width || request->length + 1 >= request->max_length;
  for (Py_ssize_t i = 0; i < taken && !ends; ++i) ends = best[chosen[i]].token == request->eos;
  if (!ends) return extend_in_place(request, best, chosen, scratch);
  PyObject* choices = PyList_New(taken);
  if (choices == NULL) return -1;
  for (Py_ssize_t i = 0; i < taken; ++i) {
    const Candidate* choice = &best[chosen[i]];
    PyObject* made = Py_BuildValue("(nLd)", (Py_ssize_t)choice->row, (long long)choice->token, choice->total);
    if (made == NULL) {
      Py_DECREF(choices);
      return -1;
    }
    PyList_SET_ITEM(choices, i, made);
  }
  PyObject* pair = Py_BuildValue("(nN)", index, choices);
  if (pair == NULL) return -1;
  const int appended = PyList_Append(handed, pair);
  Py_DECREF(pair);
  return appended;
}

static PyObject* step(PyObject* module, PyObject* args) {
  (void)module;
  PyObject *run, *binding, *objects[7], *request_list;
  long long first_id;
  Py_ssize_t stride;
  if (!PyArg_ParseTuple(args, "OOOOOOLOOOnO!", &run, &binding, &objects[0], &objects[1], &objects[2], &objects[3], &first_id,
                        &objects[4], &objects[5], &objects[6], &stride, &PyList_Type, &request_list))
    return NULL;
  const Py_ssize_t count = PyList_GET_SIZE(request_list);
  Request* requests = PyMem_Malloc(sizeof(Request) * (size_t)(count > 0 ? count : 1));
  if (requests == NULL) return PyErr_NoMemory();
  Buffers buffers = {.held = 0};
  PyObject *result = NULL, *handed = NULL;
  void* scratch = NULL;
  Py_ssize_t rows = 0, widest = 1, beam = 1;
  for (Py_ssize_t index = 0; index < count; ++index) {
    if (request_of(PyList_GET_ITEM(request_list, index), &requests[index], index) != 0) goto done;
    requests[index].first = rows;
    rows += requests[index].width;
    if (requests[index].width > widest) widest = requests[index].width;
    if (requests[index].beam_size > beam) beam = requests[index].beam_size;
  }
  if (hold(&buffers, objects) != 0) goto done;
  if (buffers.slot_ids.shape[0] < buffers.block.shape[1] || buffers.slot_ids.shape[1] < buffers.block.shape[3] ||
      buffers.block.shape[1] < rows || buffers.tgt_ids.len / 8 < rows || buffers.positions.len / 8 < rows ||
      buffers.candidate_rows.len / 8 < rows || stride < 1 || buffers.values.len / 4 < rows * stride ||
      buffers.ids.len / 8 < rows * stride) {
    PyErr_SetString(PyExc_ValueError, "the buffers must hold every row of the call (slot ids: every row and slot of the cache "
                    "block) and `stride` candidates per row");
    goto done;
  }
  // Scratch: per row a place, an origin, a free place and a token, two flags; per request's choice 2K candidates,
  // their ranks and row scores, and four new items per row.
  const size_t per_row = 3 * sizeof(Py_ssize_t) + sizeof(int64_t) + 2, rows_bytes = (size_t)(rows > 0 ? rows : 1) * per_row;
  const size_t choice_bytes =
      (size_t)(2 * beam) * (sizeof(Candidate) + sizeof(Py_ssize_t)) + (size_t)widest * (sizeof(double) + 4 * sizeof(PyObject*));
  scratch = PyMem_Malloc(rows_bytes + choice_bytes + 64);
  if (scratch == NULL) {
    PyErr_NoMemory();
    goto done;
  }
  const Py_ssize_t row_room = rows > 0 ? rows : 1;
  Candidate* best = scratch;
  Py_ssize_t* chosen = (Py_ssize_t*)(best + 2 * beam);
  double* row_scores = (double*)(chosen + 2 * beam);
  PyObject** new_items = (PyObject**)(row_scores + widest);
  Py_ssize_t* place = (Py_ssize_t*)(new_items + 4 * widest);
  Py_ssize_t* origin = place + row_room;
  Py_ssize_t* free_places = origin + row_room;
  int64_t* tokens = (int64_t*)(free_places + row_room);
  char* taken = (char*)(tokens + row_room);
  const Py_ssize_t copied = lay_out(requests, count, rows, stride, &buffers, place, origin, free_places, tokens, taken);
  if (copied < 0) goto done;
  // Numbered before the run, as StepCache.run does: a failed run may have written the slots.
  int64_t* positions = buffers.positions.buf;
  int64_t* lineage = buffers.slot_ids.buf;
  for (Py_ssize_t row = 0; row < rows; ++row) lineage[row * buffers.slot_ids.shape[1] + positions[row]] = first_id + row;
  PyObject* ran = PyObject_CallOneArg(run, binding);
  if (ran == NULL) goto done;
  Py_DECREF(ran);
  for (Py_ssize_t row = 0; row < rows; ++row) ++positions[row];
  handed = PyList_New(0);
  if (handed == NULL) goto done;
  for (Py_ssize_t index = 0; index < count; ++index)
    if (advance(&requests[index], index, &buffers, stride, row_scores, best, chosen, new_items, handed) != 0) goto done;
  result = Py_BuildValue("(nO)", copied, handed);
done:
  Py_XDECREF(handed);
  PyMem_Free(scratch);
  release(&buffers);
  PyMem_Free(requests);
  return result;
}

static PyMethodDef methods[] = {
    {"step", step, METH_VARARGS,
     "step(run, binding, cache_block, slot_ids, tgt_ids, positions, first_id, candidate_rows, candidate_log_probs, "
     "candidate_ids, stride, requests) -> (slots copied, [(request, choices)] of the requests handed back): one steady beam "
     "step (module comment); requests: per request (row ids, local parents, rows, scores, next tokens, finished, beam size, "
     "min output tokens, max length, eos), the engine's and its searcher's lists, in the call's request order"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module_definition = {PyModuleDef_HEAD_INIT, "_beam_step",
                                                "A steady beam step in C (runtime/kernels/beam_step.c).", -1, methods,
                                                NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__beam_step(void) { return PyModule_Create(&module_definition); }
