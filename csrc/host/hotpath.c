/* The host fast path (torch_cubridge/ops/hotpath.py builds and loads it).

   A Record replays one launch the Python runner made: a later call whose arguments have exactly that
   call's types, dtypes, devices, shapes, strides and plain values, on the same current stream, gets the
   same kernel with the same parameter blocks, its own data pointers patched in (8-byte words, or the
   address of a TMA tensor map), a fresh output, one cuLaunchKernel. Anything else is a miss (None) and
   the Python path decides. The GIL is held from the first patch to the launch, so two threads never
   patch one record's blocks at once. No torch headers: tensors are read through their Python methods.
   `launch` is the Python runner's own launch (ops/launch.py): its parameter blocks as bytes, one
   cuLaunchKernel, for the calls that miss every record. A Decoder (decoder.h) launches the decode
   kernel for any sizes. `signature` is capture/signature.py's call_signature (signature.h). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_ARGS 16
#define MAX_BLOCKS 16
#define MAX_PATCH 24
#define MAX_PARAM_BYTES 8192
#define CUDA_ERROR_INVALID_CONTEXT 201

typedef int CUresult;
typedef CUresult (*launch_fn)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                              void *, void **, void **);
typedef CUresult (*replace_fn)(void *, void *);
typedef CUresult (*errname_fn)(CUresult, const char **);

static launch_fn cu_launch;
static replace_fn cu_replace;
static errname_fn cu_errname;
static PyObject *s_dtype, *s_shape, *s_stride, *s_get_device, *s_data_ptr, *s_requires_grad, *s_new_empty_strided;

static int load_driver(void) {
    if (cu_launch) return 0;
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (!h) {
        PyErr_Format(PyExc_RuntimeError, "cannot load libcuda.so.1: %s", dlerror());
        return -1;
    }
    cu_replace = (replace_fn)dlsym(h, "cuTensorMapReplaceAddress");
    cu_errname = (errname_fn)dlsym(h, "cuGetErrorName");
    cu_launch = (launch_fn)dlsym(h, "cuLaunchKernel");
    if (!cu_launch) {
        PyErr_SetString(PyExc_RuntimeError, "libcuda.so.1 has no cuLaunchKernel");
        return -1;
    }
    return 0;
}

typedef struct {
    PyObject_HEAD
    Py_ssize_t nargs;
    PyObject *expect;           /* per argument: (dtype, device, shape, stride) of a tensor, or the value */
    char is_tensor[MAX_ARGS];
    int nsrc, src_arg[MAX_ARGS]; /* arguments whose data pointers are patched in; source nsrc is the output */
    int npatch, p_src[MAX_PATCH], p_block[MAX_PATCH], p_tmap[MAX_PATCH];
    Py_ssize_t p_off[MAX_PATCH];
    int nblocks;
    void *mem;                  /* every block, each 64-byte aligned (tensor maps must be) */
    void *kparams[MAX_BLOCKS];
    void *fn;
    unsigned grid[3], threads, smem;
    unsigned long long stream;
    long device;
    PyObject *tensor_type, *out_shape, *out_stride, *get_stream, *capturing, *keep, *device_obj;
    int like_arg;               /* the output: args[like_arg].new_empty_strided(out_shape, out_stride), the
                                   runner's new_empty (a third faster than new_empty from Python's side) */
    Py_ssize_t hits;
} Record;

static void Record_dealloc(Record *r) {
    Py_XDECREF(r->expect);
    Py_XDECREF(r->tensor_type);
    Py_XDECREF(r->out_shape);
    Py_XDECREF(r->out_stride);
    Py_XDECREF(r->device_obj);
    Py_XDECREF(r->get_stream);
    Py_XDECREF(r->capturing);
    Py_XDECREF(r->keep);
    free(r->mem);
    Py_TYPE(r)->tp_free((PyObject *)r);
}

/* Record(expect, is_tensor, src_args, patches, blocks, fn, grid, threads, smem, stream, device,
          tensor_type, out_shape, out_stride, like_arg, get_stream, capturing, keep)
   patches: (source, block, offset, is_tensor_map) tuples. */
static int Record_init(Record *r, PyObject *args, PyObject *kw) {
    PyObject *expect, *is_tensor, *src_args, *patches, *blocks, *grid, *tensor_type, *out_shape, *out_stride,
        *get_stream, *capturing, *keep;
    int like_arg;
    unsigned long long fn, stream;
    unsigned threads, smem;
    long device;
    if (!PyArg_ParseTuple(args, "O!O!O!O!O!KO!IIKlOO!O!iOOO", &PyTuple_Type, &expect, &PyTuple_Type, &is_tensor,
                          &PyTuple_Type, &src_args, &PyTuple_Type, &patches, &PyTuple_Type, &blocks, &fn,
                          &PyTuple_Type, &grid, &threads, &smem, &stream, &device, &tensor_type, &PyTuple_Type,
                          &out_shape, &PyTuple_Type, &out_stride, &like_arg, &get_stream, &capturing, &keep))
        return -1;
    r->nargs = PyTuple_GET_SIZE(expect);
    if (r->nargs > MAX_ARGS || PyTuple_GET_SIZE(is_tensor) != r->nargs || PyTuple_GET_SIZE(src_args) >= MAX_ARGS ||
        PyTuple_GET_SIZE(patches) > MAX_PATCH || PyTuple_GET_SIZE(blocks) > MAX_BLOCKS ||
        PyTuple_GET_SIZE(grid) != 3) {
        PyErr_SetString(PyExc_ValueError, "record too large or malformed");
        return -1;
    }
    for (Py_ssize_t i = 0; i < r->nargs; i++) r->is_tensor[i] = (char)PyObject_IsTrue(PyTuple_GET_ITEM(is_tensor, i));
    if (like_arg < 0 || like_arg >= r->nargs || !r->is_tensor[like_arg]) {
        PyErr_SetString(PyExc_ValueError, "the output is made like a tensor argument");
        return -1;
    }
    r->like_arg = like_arg;
    PyObject *dev = PyLong_FromLong(device);
    if (!dev) return -1;
    Py_XSETREF(r->device_obj, dev);
    r->nsrc = (int)PyTuple_GET_SIZE(src_args);
    for (int i = 0; i < r->nsrc; i++) {
        long a = PyLong_AsLong(PyTuple_GET_ITEM(src_args, i));
        if (a < 0 || a >= r->nargs || !r->is_tensor[a]) {
            PyErr_SetString(PyExc_ValueError, "a pointer source must be a tensor argument");
            return -1;
        }
        r->src_arg[i] = (int)a;
    }
    r->nblocks = (int)PyTuple_GET_SIZE(blocks);
    Py_ssize_t total = 0, offs[MAX_BLOCKS], lens[MAX_BLOCKS];
    for (int b = 0; b < r->nblocks; b++) {
        PyObject *blk = PyTuple_GET_ITEM(blocks, b);
        if (!PyBytes_Check(blk)) {
            PyErr_SetString(PyExc_TypeError, "blocks must be bytes");
            return -1;
        }
        lens[b] = PyBytes_GET_SIZE(blk);
        offs[b] = total;
        total += (lens[b] + 63) & ~(Py_ssize_t)63;
    }
    free(r->mem);
    r->mem = NULL;
    if (total && posix_memalign(&r->mem, 64, (size_t)total)) {
        PyErr_NoMemory();
        return -1;
    }
    for (int b = 0; b < r->nblocks; b++) {
        r->kparams[b] = (char *)r->mem + offs[b];
        memcpy(r->kparams[b], PyBytes_AS_STRING(PyTuple_GET_ITEM(blocks, b)), (size_t)lens[b]);
    }
    r->npatch = (int)PyTuple_GET_SIZE(patches);
    for (int i = 0; i < r->npatch; i++) {
        int src, blk, tmap;
        Py_ssize_t off;
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(patches, i), "iinp", &src, &blk, &off, &tmap)) return -1;
        if (src < 0 || src > r->nsrc || blk < 0 || blk >= r->nblocks || off < 0 ||
            off + (tmap ? 128 : 8) > lens[blk] || (tmap && off % 64)) {
            PyErr_SetString(PyExc_ValueError, "a patch outside its block");
            return -1;
        }
        r->p_src[i] = src;
        r->p_block[i] = blk;
        r->p_off[i] = off;
        r->p_tmap[i] = tmap;
    }
    for (int i = 0; i < 3; i++) r->grid[i] = (unsigned)PyLong_AsUnsignedLong(PyTuple_GET_ITEM(grid, i));
    if (PyErr_Occurred()) return -1;
    r->fn = (void *)(uintptr_t)fn;
    r->threads = threads;
    r->smem = smem;
    r->stream = stream;
    r->device = device;
#define SET(field, v) do { Py_XSETREF(r->field, v); Py_INCREF(v); } while (0)
    SET(expect, expect);
    SET(tensor_type, tensor_type);
    SET(out_shape, out_shape);
    SET(out_stride, out_stride);
    SET(get_stream, get_stream);
    SET(capturing, capturing);
    SET(keep, keep);
#undef SET
    for (int i = 0; i < r->npatch; i++)
        if (r->p_tmap[i] && load_driver() == 0 && !cu_replace) {
            PyErr_SetString(PyExc_RuntimeError, "this CUDA driver has no cuTensorMapReplaceAddress");
            return -1;
        }
    return load_driver();
}

static PyObject *Record_hits(Record *r, void *unused) { return PyLong_FromSsize_t(r->hits); }

static PyGetSetDef Record_getset[] = {
    {"hits", (getter)Record_hits, NULL, "calls this record launched", NULL},
    {NULL},
};

static PyTypeObject RecordType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "torch_cubridge._hotpath.Record",
    .tp_basicsize = sizeof(Record),
    .tp_dealloc = (destructor)Record_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "one launch, replayed for calls of exactly its arguments' layout",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Record_init,
    .tp_getset = Record_getset,
};

/* What a call's tensor arguments are, read once per call and shared by every record tried. */
typedef struct {
    char got;
    PyObject *dtype, *shape, *stride;
    long device;
    int grad;
} Seen;

static void forget(Seen *seen, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++)
        if (seen[i].got) {
            Py_XDECREF(seen[i].dtype);
            Py_XDECREF(seen[i].shape);
            Py_XDECREF(seen[i].stride);
        }
}

static int see(PyObject *t, Seen *s) {
    s->got = 1;
    s->dtype = PyObject_GetAttr(t, s_dtype);
    s->shape = s->dtype ? PyObject_GetAttr(t, s_shape) : NULL;
    s->stride = s->shape ? PyObject_CallMethodNoArgs(t, s_stride) : NULL;
    if (!s->stride) return -1;
    PyObject *d = PyObject_CallMethodNoArgs(t, s_get_device);
    if (!d) return -1;
    s->device = PyLong_AsLong(d);
    Py_DECREF(d);
    PyObject *g = PyObject_GetAttr(t, s_requires_grad);
    if (!g) return -1;
    s->grad = (g == Py_True);
    Py_DECREF(g);
    return PyErr_Occurred() ? -1 : 0;
}

static int eq(PyObject *a, PyObject *b) { return a == b || PyObject_RichCompareBool(a, b, Py_EQ) == 1; }

/* 1: the call matches the record, 0: it does not, -1: an error. */
static int matches(Record *r, PyObject *args, Seen *seen) {
    for (Py_ssize_t i = 0; i < r->nargs; i++) {
        PyObject *x = PyTuple_GET_ITEM(args, i), *e = PyTuple_GET_ITEM(r->expect, i);
        if (r->is_tensor[i]) {
            if (Py_TYPE(x) != (PyTypeObject *)r->tensor_type) return 0;
            if (!seen[i].got && see(x, &seen[i]) < 0) return -1;
            Seen *s = &seen[i];
            if (s->grad || s->dtype != PyTuple_GET_ITEM(e, 0) || s->device != PyLong_AsLong(PyTuple_GET_ITEM(e, 1)) ||
                !eq(s->shape, PyTuple_GET_ITEM(e, 2)) || !eq(s->stride, PyTuple_GET_ITEM(e, 3)))
                return 0;
        } else if (x != e && (Py_TYPE(x) != Py_TYPE(e) || PyObject_RichCompareBool(x, e, Py_EQ) != 1)) {
            if (PyErr_Occurred()) PyErr_Clear();
            return 0;
        }
    }
    return 1;
}

static int pointer(PyObject *t, unsigned long long *p) {
    PyObject *v = PyObject_CallMethodNoArgs(t, s_data_ptr);
    if (!v) return -1;
    *p = PyLong_AsUnsignedLongLong(v);
    Py_DECREF(v);
    return PyErr_Occurred() ? -1 : 0;
}

/* What a launch made for `out` gives back: out; None where the thread has no current context (one torch
   never made current: the Python path fixes it and launches); else an error naming the driver's. */
static PyObject *after_launch(CUresult rc, PyObject *out) {
    if (rc == CUDA_ERROR_INVALID_CONTEXT) {
        Py_DECREF(out);
        Py_RETURN_NONE;
    }
    if (rc) {
        const char *name = NULL;
        if (cu_errname) cu_errname(rc, &name);
        Py_DECREF(out);
        PyErr_Format(PyExc_RuntimeError, "cuLaunchKernel failed: %s (%d)", name ? name : "?", rc);
        return NULL;
    }
    return out;
}

/* The launch of a matching call: the output, or None where this call must take the Python path. */
static PyObject *fire(Record *r, PyObject *args) {
    unsigned long long ptr[MAX_ARGS + 1];
    for (int i = 0; i < r->nsrc; i++) {
        if (pointer(PyTuple_GET_ITEM(args, r->src_arg[i]), &ptr[i]) < 0) return NULL;
        if (ptr[i] % 16) Py_RETURN_NONE;  /* the recorded call's rows were 16-byte aligned: this one copies */
    }
    if (r->capturing != Py_None) {  /* a graph captures its own scratch (ops.runner._scratch_for) */
        PyObject *c = PyObject_CallNoArgs(r->capturing);
        if (!c) return NULL;
        int cap = PyObject_IsTrue(c);
        Py_DECREF(c);
        if (cap) Py_RETURN_NONE;
    }
    PyObject *st = PyObject_CallOneArg(r->get_stream, r->device_obj);
    if (!st) return NULL;
    unsigned long long stream = PyLong_AsUnsignedLongLong(st);
    Py_DECREF(st);
    if (PyErr_Occurred()) return NULL;
    if (stream != r->stream) Py_RETURN_NONE;
    PyObject *call[3] = {PyTuple_GET_ITEM(args, r->like_arg), r->out_shape, r->out_stride};
    PyObject *out = PyObject_VectorcallMethod(s_new_empty_strided, call, 3, NULL);
    if (!out) return NULL;
    if (pointer(out, &ptr[r->nsrc]) < 0) {
        Py_DECREF(out);
        return NULL;
    }
    /* from here to the launch no Python code runs: the GIL keeps the blocks ours */
    for (int i = 0; i < r->npatch; i++) {
        char *at = (char *)r->kparams[r->p_block[i]] + r->p_off[i];
        unsigned long long v = ptr[r->p_src[i]];
        if (r->p_tmap[i]) {
            CUresult rc = cu_replace(at, (void *)(uintptr_t)v);
            if (rc) {
                Py_DECREF(out);
                PyErr_Format(PyExc_RuntimeError, "cuTensorMapReplaceAddress failed (%d)", rc);
                return NULL;
            }
        } else {
            memcpy(at, &v, 8);
        }
    }
    CUresult rc = cu_launch(r->fn, r->grid[0], r->grid[1], r->grid[2], r->threads, 1, 1, r->smem,
                            (void *)(uintptr_t)stream, r->kparams, NULL);
    out = after_launch(rc, out);
    if (out && out != Py_None) r->hits++;
    return out;
}

#include "decoder.h"
#include "signature.h"

/* Whether every global binding and closure cell the spec read still holds the object it held at capture
   (capture/codekey.py GlobalsWatch.held: (namespaces, cells, missing)); a rebinding is a miss, and the
   Python path then forgets the programs. 1: holds, 0: does not, -1: an error. */
static int watch_holds(PyObject *w) {
    if (w == Py_None) return 1;
    if (!PyTuple_Check(w) || PyTuple_GET_SIZE(w) != 3) return 0;
    PyObject *spaces = PyTuple_GET_ITEM(w, 0), *cells = PyTuple_GET_ITEM(w, 1), *missing = PyTuple_GET_ITEM(w, 2);
    if (!PyTuple_Check(spaces) || !PyTuple_Check(cells)) return 0;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(spaces); i++) {
        PyObject *e = PyTuple_GET_ITEM(spaces, i);
        if (!PyTuple_Check(e) || PyTuple_GET_SIZE(e) != 3) return 0;
        PyObject *ns = PyTuple_GET_ITEM(e, 0), *names = PyTuple_GET_ITEM(e, 1), *held = PyTuple_GET_ITEM(e, 2);
        if (!PyDict_Check(ns) || !PyTuple_Check(names) || !PyTuple_Check(held) ||
            PyTuple_GET_SIZE(names) != PyTuple_GET_SIZE(held))
            return 0;
        for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(names); j++) {
            PyObject *now = PyDict_GetItemWithError(ns, PyTuple_GET_ITEM(names, j));  /* borrowed */
            if (!now && PyErr_Occurred()) return -1;
            if (now != PyTuple_GET_ITEM(held, j)) return 0;  /* rebound, or deleted (NULL) */
        }
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(cells); i++) {
        PyObject *e = PyTuple_GET_ITEM(cells, i);
        if (!PyTuple_Check(e) || PyTuple_GET_SIZE(e) != 2 || !PyCell_Check(PyTuple_GET_ITEM(e, 0))) return 0;
        PyObject *now = PyCell_GET(PyTuple_GET_ITEM(e, 0)), *held = PyTuple_GET_ITEM(e, 1);
        if (now ? now != held : held != missing) return 0;
    }
    return 1;
}

/* serve(records, args[, watch]): the output of the first record the call matches, or None; None too where
   the watch (GlobalsWatch.held) no longer holds. */
static PyObject *serve(PyObject *self, PyObject *const *a, Py_ssize_t n) {
    if ((n != 2 && n != 3) || !PyList_Check(a[0]) || !PyTuple_Check(a[1])) {
        PyErr_SetString(PyExc_TypeError, "serve(records: list, args: tuple[, watch])");
        return NULL;
    }
    if (n == 3) {
        int w = watch_holds(a[2]);
        if (w < 0) return NULL;
        if (!w) Py_RETURN_NONE;
    }
    PyObject *records = a[0], *args = a[1];
    Py_ssize_t nargs = PyTuple_GET_SIZE(args);
    if (nargs > MAX_ARGS) Py_RETURN_NONE;
    Seen seen[MAX_ARGS];
    memset(seen, 0, sizeof(seen));
    PyObject *result = Py_None;
    Py_INCREF(result);
    for (Py_ssize_t j = 0; j < PyList_GET_SIZE(records); j++) {
        Record *r = (Record *)PyList_GET_ITEM(records, j);
        if (Py_TYPE(r) != &RecordType || r->nargs != nargs) continue;
        Py_INCREF(r);  /* matching and firing call Python, which may let another thread drop r from the list */
        int m = matches(r, args, seen);
        if (m < 0) {
            Py_DECREF(r);
            Py_CLEAR(result);
            break;
        }
        if (m) {
            Py_DECREF(result);
            result = fire(r, args);
            Py_DECREF(r);
            break;
        }
        Py_DECREF(r);
    }
    forget(seen, nargs);
    return result;
}


/* launch(fn, gx, gy, gz, threads, smem, stream, blocks, sizes): cuLaunchKernel with each parameter block
   (bytes) copied to its own 64-byte-aligned place (tensor maps must be); `sizes` (a tuple, or None where the
   driver cannot say) are the kernel's parameter sizes, which the blocks must match. Returns the CUresult;
   -1 where the blocks are not all bytes or do not fit this call's buffer (the caller launches another way). */
static PyObject *launch(PyObject *self, PyObject *const *a, Py_ssize_t n) {
    if (n != 9 || !PyTuple_Check(a[7]) || (a[8] != Py_None && !PyTuple_Check(a[8]))) {
        PyErr_SetString(PyExc_TypeError, "launch(fn, gx, gy, gz, threads, smem, stream, blocks: tuple, sizes)");
        return NULL;
    }
    if (load_driver() < 0) return NULL;
    unsigned long long fn = PyLong_AsUnsignedLongLong(a[0]), stream = PyLong_AsUnsignedLongLong(a[6]);
    unsigned long v[5];
    for (int i = 0; i < 5; i++) v[i] = PyLong_AsUnsignedLong(a[1 + i]);
    if (PyErr_Occurred()) return NULL;
    PyObject *blocks = a[7], *sizes = a[8];
    Py_ssize_t nb = PyTuple_GET_SIZE(blocks);
    if (nb > MAX_BLOCKS) return PyLong_FromLong(-1);
    if (sizes != Py_None && PyTuple_GET_SIZE(sizes) != nb) {
        PyErr_Format(PyExc_ValueError, "kernel parameters: %zd, got %zd blocks", PyTuple_GET_SIZE(sizes), nb);
        return NULL;
    }
    _Alignas(64) unsigned char buf[MAX_PARAM_BYTES];
    void *kparams[MAX_BLOCKS];
    size_t off = 0;
    for (Py_ssize_t i = 0; i < nb; i++) {
        PyObject *b = PyTuple_GET_ITEM(blocks, i);
        if (!PyBytes_Check(b)) return PyLong_FromLong(-1);  /* a buffer of another type: the caller's own path */
        Py_ssize_t len = PyBytes_GET_SIZE(b);
        if (sizes != Py_None) {
            Py_ssize_t want = PyLong_AsSsize_t(PyTuple_GET_ITEM(sizes, i));
            if (want != len) {
                if (!PyErr_Occurred())
                    PyErr_Format(PyExc_ValueError, "kernel parameters: number %zd is %zd bytes, got a block of %zd", i, want, len);
                return NULL;
            }
        }
        if (off + (size_t)len > MAX_PARAM_BYTES) return PyLong_FromLong(-1);
        memcpy(buf + off, PyBytes_AS_STRING(b), (size_t)len);
        kparams[i] = buf + off;
        off = (off + (size_t)len + 63) & ~(size_t)63;
    }
    CUresult rc = cu_launch((void *)(uintptr_t)fn, (unsigned)v[0], (unsigned)v[1], (unsigned)v[2], (unsigned)v[3], 1, 1,
                            (unsigned)v[4], (void *)(uintptr_t)stream, kparams, NULL);
    return PyLong_FromLong(rc);
}

static PyObject *holds(PyObject *self, PyObject *w) {
    int r = watch_holds(w);
    if (r < 0) return NULL;
    return PyBool_FromLong(r);
}

static PyMethodDef methods[] = {
    {"serve", (PyCFunction)(void (*)(void))serve, METH_FASTCALL, "the first matching record's launch, or None"},
    {"holds", (PyCFunction)holds, METH_O, "whether a GlobalsWatch.held() still holds (serve's own check)"},
    {"launch", (PyCFunction)(void (*)(void))launch, METH_FASTCALL, "cuLaunchKernel of bytes parameter blocks"},
    {"signature", (PyCFunction)(void (*)(void))signature, METH_FASTCALL, "capture/signature.py's call_signature"},
    {"configure_signature", (PyCFunction)configure_signature, METH_VARARGS,
     "signature.py's kinds table, its _kind, _same and _ONE, and the kinds' numbers (tensor, plain, seq)"},
    {NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_hotpath", NULL, -1, methods};

PyMODINIT_FUNC PyInit__hotpath(void) {
    if (PyType_Ready(&RecordType) < 0 || PyType_Ready(&DecoderType) < 0) return NULL;
    s_dtype = PyUnicode_InternFromString("dtype");
    s_shape = PyUnicode_InternFromString("shape");
    s_stride = PyUnicode_InternFromString("stride");
    s_get_device = PyUnicode_InternFromString("get_device");
    s_data_ptr = PyUnicode_InternFromString("data_ptr");
    s_requires_grad = PyUnicode_InternFromString("requires_grad");
    s_new_empty_strided = PyUnicode_InternFromString("new_empty_strided");
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    Py_INCREF(&RecordType);
    if (PyModule_AddObject(m, "Record", (PyObject *)&RecordType) < 0) return NULL;
    Py_INCREF(&DecoderType);
    if (PyModule_AddObject(m, "Decoder", (PyObject *)&DecoderType) < 0) return NULL;
    return m;
}
