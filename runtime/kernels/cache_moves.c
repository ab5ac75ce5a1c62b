// The step cache's row moves as a CPython extension (nmt_serve.runtime._cache_moves): what StepCache._copy_rows
// (runtime/step_cache.py) does with two numpy slice assignments per moved row, each destination row taking its origin
// row's cached slots [first, length) of every layer's K and V, and their slot lineage numbers.
//
// And the sources' moves (`copy_sources`): an encoded source into the engine's pool slot, a pool slot into a place of a
// step cache's source group (server/engine/source_pool.py, runtime/source_group.py), every layer's K and V and the mask
// in one call where numpy took two slice assignments per tensor.
//
// Why: a beam step moves the rows whose parents changed; at batch 32 beam 4 about 60-100 rows a step, and each numpy
// assignment costs microseconds before it copies anything, so the moves took more than three times the copy itself.
// Here each (tensor, head) block of a move is one memcpy.
//
// Same bytes: the cache and lineage arrays are C-ordered, so a row's slots [first, length) of one (tensor, head) are
// one contiguous run; the caller moves rows only between distinct rows (no copy reads a row another one writes).

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

// A writable C-contiguous view of `object` with `ndim` dimensions; `name` goes into the error.
static int writable_view(PyObject* object, Py_buffer* view, int ndim, const char* name) {
  if (PyObject_GetBuffer(object, view, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) != 0) return -1;
  if (view->ndim != ndim) {
    PyErr_Format(PyExc_ValueError, "%s must be a %d-D C-ordered array, got %d-D", name, ndim, view->ndim);
    PyBuffer_Release(view);
    return -1;
  }
  return 0;
}

// Item `index` of a list of ints (or of objects with __index__), or -1 with an error set.
static Py_ssize_t item(PyObject* list, Py_ssize_t index) {
  return PyNumber_AsSsize_t(PyList_GET_ITEM(list, index), PyExc_OverflowError);
}

static PyObject* copy_rows(PyObject* module, PyObject* args) {
  (void)module;
  PyObject *block_object, *ids_object, *destination, *origin, *firsts, *lengths;
  if (!PyArg_ParseTuple(args, "OOO!O!OO!", &block_object, &ids_object, &PyList_Type, &destination, &PyList_Type, &origin, &firsts,
                        &PyList_Type, &lengths))
    return NULL;
  const Py_ssize_t moves = PyList_GET_SIZE(destination);
  const int find_firsts = firsts == Py_None;
  if (!find_firsts && !PyList_Check(firsts)) {
    PyErr_SetString(PyExc_TypeError, "firsts must be a list of ints or None");
    return NULL;
  }
  if (PyList_GET_SIZE(origin) != moves || (!find_firsts && PyList_GET_SIZE(firsts) != moves) || PyList_GET_SIZE(lengths) != moves) {
    PyErr_SetString(PyExc_ValueError, "destination, origin, firsts and lengths must be lists of one length");
    return NULL;
  }
  Py_buffer block, ids;
  if (writable_view(block_object, &block, 5, "the cache block (tensors, rows, heads, length, head dim)") != 0) return NULL;
  if (writable_view(ids_object, &ids, 2, "the slot ids (rows, length)") != 0) {
    PyBuffer_Release(&block);
    return NULL;
  }
  const Py_ssize_t tensors = block.shape[0], rows = block.shape[1], heads = block.shape[2], capacity = block.shape[3];
  const Py_ssize_t slot_bytes = block.shape[4] * block.itemsize;
  Py_ssize_t copied = 0;
  int failed = 0;
  if (ids.shape[0] < rows || ids.shape[1] < capacity || ids.itemsize != 8) {
    PyErr_SetString(PyExc_ValueError, "the slot ids must be int64 and cover every row and slot of the cache block");
    failed = 1;
  }
  for (Py_ssize_t move = 0; move < moves && !failed; ++move) {
    const Py_ssize_t row = item(destination, move), from = item(origin, move), end = item(lengths, move);
    Py_ssize_t first = find_firsts ? 0 : item(firsts, move);
    if (PyErr_Occurred()) {
      failed = 1;
      break;
    }
    if (row < 0 || row >= rows || from < 0 || from >= rows || row == from || first < 0 || end > capacity) {
      PyErr_Format(PyExc_ValueError, "move %zd: row %zd from row %zd, slots [%zd, %zd): outside the block of %zd rows x %zd slots, or onto itself",
                   move, row, from, first, end, rows, capacity);
      failed = 1;
      break;
    }
    int64_t* lineage = (int64_t*)ids.buf;
    if (find_firsts) {  // the first slot whose lineage differs; 0 (never proven equal) differs from everything
      const int64_t *have = lineage + row * ids.shape[1], *want = lineage + from * ids.shape[1];
      while (first < end && want[first] != 0 && have[first] == want[first]) ++first;
    }
    if (first >= end) continue;
    const size_t bytes = (size_t)((end - first) * slot_bytes);
    for (Py_ssize_t tensor = 0; tensor < tensors; ++tensor)
      for (Py_ssize_t head = 0; head < heads; ++head) {
        char* base = (char*)block.buf + (tensor * rows * heads + head) * capacity * slot_bytes + first * slot_bytes;
        memcpy(base + row * heads * capacity * slot_bytes, base + from * heads * capacity * slot_bytes, bytes);
      }
    memcpy(lineage + row * ids.shape[1] + first, lineage + from * ids.shape[1] + first, (size_t)(end - first) * sizeof(int64_t));
    copied += end - first;
  }
  PyBuffer_Release(&block);
  PyBuffer_Release(&ids);
  return failed ? NULL : PyLong_FromSsize_t(copied);
}

// The (items, heads, width, depth) extents of a 4-D array, or of a 2-D (items, width) one as (items, 1, width, 1).
static int source_extents(const Py_buffer* view, Py_ssize_t extents[4], const char* name) {
  if (view->ndim == 4) {
    for (int axis = 0; axis < 4; ++axis) extents[axis] = view->shape[axis];
    return 0;
  }
  if (view->ndim == 2) {
    extents[0] = view->shape[0], extents[1] = 1, extents[2] = view->shape[1], extents[3] = 1;
    return 0;
  }
  PyErr_Format(PyExc_ValueError, "%s must be 4-D (items, heads, width, head dim) or 2-D (items, width), got %d-D", name, view->ndim);
  return -1;
}

// One destination/origin pair of copy_sources: origin[row, :, :width] into destination[place, :, :width], and the
// destination's columns past `width` zeroed when `clear_tail`.
static int copy_source(PyObject* destination_object, PyObject* origin_object, Py_ssize_t place, Py_ssize_t row, Py_ssize_t width,
                       int clear_tail, Py_ssize_t pair) {
  Py_buffer destination, origin;
  if (PyObject_GetBuffer(destination_object, &destination, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE | PyBUF_FORMAT) != 0) return -1;
  if (PyObject_GetBuffer(origin_object, &origin, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) != 0) {
    PyBuffer_Release(&destination);
    return -1;
  }
  Py_ssize_t to[4], from[4];
  int failed = source_extents(&destination, to, "a destination") != 0 || source_extents(&origin, from, "an origin") != 0;
  if (!failed && (to[1] != from[1] || to[3] != from[3] || destination.itemsize != origin.itemsize ||
                  strcmp(destination.format ? destination.format : "B", origin.format ? origin.format : "B") != 0)) {
    PyErr_Format(PyExc_ValueError, "pair %zd: the destination and origin differ in heads, head dim or item type", pair);
    failed = 1;
  }
  if (!failed && (place < 0 || place >= to[0] || row < 0 || row >= from[0] || width < 0 || width > to[2] || width > from[2])) {
    PyErr_Format(PyExc_ValueError, "pair %zd: place %zd of %zd, row %zd of %zd, width %zd of %zd and %zd: outside the arrays", pair,
                 place, to[0], row, from[0], width, to[2], from[2]);
    failed = 1;
  }
  if (!failed) {
    const size_t column = (size_t)(to[3] * destination.itemsize);
    for (Py_ssize_t head = 0; head < to[1]; ++head) {
      char* target = (char*)destination.buf + ((place * to[1] + head) * to[2]) * column;
      const char* source = (const char*)origin.buf + ((row * from[1] + head) * from[2]) * column;
      memcpy(target, source, (size_t)width * column);
      if (clear_tail) memset(target + width * column, 0, (size_t)(to[2] - width) * column);
    }
  }
  PyBuffer_Release(&destination);
  PyBuffer_Release(&origin);
  return failed ? -1 : 0;
}

static PyObject* copy_sources(PyObject* module, PyObject* args) {
  (void)module;
  PyObject *destinations, *origins;
  Py_ssize_t place, row, width;
  int clear_tail;
  if (!PyArg_ParseTuple(args, "O!O!nnnp", &PyList_Type, &destinations, &PyList_Type, &origins, &place, &row, &width, &clear_tail))
    return NULL;
  const Py_ssize_t pairs = PyList_GET_SIZE(destinations);
  if (PyList_GET_SIZE(origins) != pairs) {
    PyErr_SetString(PyExc_ValueError, "destinations and origins must be lists of one length");
    return NULL;
  }
  for (Py_ssize_t pair = 0; pair < pairs; ++pair)
    if (copy_source(PyList_GET_ITEM(destinations, pair), PyList_GET_ITEM(origins, pair), place, row, width, clear_tail, pair) != 0)
      return NULL;
  Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"copy_rows", copy_rows, METH_VARARGS,
     "copy_rows(block, ids, destination, origin, firsts, lengths) -> slots copied: each destination row takes its origin row's "
     "slots [first, length) of every (tensor, head) of the cache block and of the slot ids; firsts None: each move's first "
     "slot whose lineage number differs (or is 0, unknown)"},
    {"copy_sources", copy_sources, METH_VARARGS,
     "copy_sources(destinations, origins, place, row, width, clear_tail) -> None: for each pair, origin[row, :, :width] into "
     "destination[place, :, :width] (4-D (items, heads, width, head dim) or 2-D (items, width) C-ordered arrays of one item "
     "type), and the destination's columns past width zeroed when clear_tail"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module_definition = {PyModuleDef_HEAD_INIT, "_cache_moves",
                                                "The step cache's row moves in C (runtime/kernels/cache_moves.c).", -1, methods,
                                                NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__cache_moves(void) { return PyModule_Create(&module_definition); }
