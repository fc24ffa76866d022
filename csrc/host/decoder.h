/* The decode kernel's launch in C, for any sizes (included by hotpath.c, which owns the driver, the
   interned names, `pointer` and `after_launch`).

   A Decoder is made once per runner of the split-KV decode kernel (ops/runner.py) with everything the
   runner works out from its program alone: the operands' dim orders, the output's layout, the scale, the
   Params block, the split rule. A call then reads q's, k's and v's dtype, device, shape, strides and
   pointers, checks what the Python runner checks, allocates the output, packs FwdArgs and launches:
   what a decode step over a growing KV cache needs, whose layout never repeats (so no Record replays it).
   Any call it does not take as it is (another dtype or device, a tensor that needs grad while grad is on,
   rows not 16-byte aligned, shapes that do not fit, no keys, a CUDA graph capturing, split scratch too
   small or of another stream, a thread without a context) returns None, and the Python runner serves it
   (and raises where it must). The split scratch is the runner's (set_scratch hands it over).

   Paged K and V (a serving loop's cache): serve(q, k_pages, v_pages, k_table, v_table, extras...), the
   pages' dims described as operands with no batch dim, the PagedKV words packed per call (the runner's
   _pages). Extra tensors (sequence lengths, a padding mask) are call arguments whose pointers, strides and
   sizes are patched into a Params template; where the program reads them at computed indices, the
   runner's bounds check runs for every new (sizes, extra shapes) and its yes is kept.

   What the Python runner and this path share is not written here: the FwdArgs and PagedKV structs, the
   decode kernel's parameter order (DEC_*) and the launch rules (rows_aligned, shapes_fit, pool_fits,
   page_div, decode_split) come from host_rules.h, which ops/host_header.py renders from the kernel headers
   and torch_cubridge/ops/layout.py and rules.py, and build/host.py writes beside the build. */

#include "host_rules.h"

#define DEC_MAX_EXTRAS 6
#define DEC_MAX_PATCHES 24
#define DEC_KEY_LEN (6 + 4 * DEC_MAX_EXTRAS)

typedef struct {
    PyObject_HEAD
    PyObject *tensor_type, *dtype, *get_stream, *capturing, *grad_enabled, *device_obj, *params, *pages,
        *scratch_keep, *i32, *i64, *extra_dtypes, *bounds;
    int rank[3], perm[3][4];  /* per operand q, k, v: its rank and where b, h, s, d are (-1: no such dim) */
    int nout, out_len[4], out_dims[4][4];  /* the output's dims: each a group of canonical dims (b h s d) */
    long long head_dim, value_dim, block_m, block_n, ctas_per_sm, sm_count, min_blocks;
    double scale;
    void *fn;
    unsigned threads, smem;
    long device;
    /* the runner's split scratch: its stream, its capacities (floats of O, of (max, sum), counters), its words */
    unsigned long long s_stream;
    long long s_o, s_l, s_counters;
    unsigned char s_words[24];
    int has_scratch;
    int nreq, req_at[6];  /* sizes the program holds only at one value: index into (B, H, Hkv, Sq, Skv, D) */
    long long req_val[6];
    int paged;        /* K and V are pages (no batch dim) read through two block tables */
    long long heads;  /* paged: the spec's KV head count, as the program's held sizes name it */
    int nextra, extra_rank[DEC_MAX_EXTRAS];
    int npatch, patch_off[DEC_MAX_PATCHES], patch_kind[DEC_MAX_PATCHES], patch_src[DEC_MAX_PATCHES],
        patch_dim[DEC_MAX_PATCHES];  /* Params words taken per call: kind 0 an extra's pointer, 1 stride, 2 size */
    int has_key;
    long long key[DEC_KEY_LEN];  /* the (B, H, Hkv, Sq, Skv, D, extra shapes) the bounds check last said yes to */
    Py_ssize_t hits;
} Decoder;

static void Decoder_dealloc(Decoder *d) {
    Py_XDECREF(d->tensor_type);
    Py_XDECREF(d->dtype);
    Py_XDECREF(d->get_stream);
    Py_XDECREF(d->capturing);
    Py_XDECREF(d->grad_enabled);
    Py_XDECREF(d->device_obj);
    Py_XDECREF(d->params);
    Py_XDECREF(d->pages);
    Py_XDECREF(d->scratch_keep);
    Py_XDECREF(d->i32);
    Py_XDECREF(d->i64);
    Py_XDECREF(d->extra_dtypes);
    Py_XDECREF(d->bounds);
    Py_TYPE(d)->tp_free((PyObject *)d);
}

static int int_items(PyObject *t, int *out, Py_ssize_t n, const char *what) {
    if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != n) {
        PyErr_Format(PyExc_ValueError, "%s: a tuple of %zd ints", what, n);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) out[i] = (int)PyLong_AsLong(PyTuple_GET_ITEM(t, i));
    return PyErr_Occurred() ? -1 : 0;
}

/* Decoder(tensor_type, dtype, ranks, perms, out_dims, head_dim, value_dim, block_m, block_n, fn, threads, smem,
           device, scale, params, pages, ctas_per_sm, sm_count, min_blocks, get_stream, capturing, grad_enabled, requires,
           paged, extras, patches, bounds)
   perms: three (b, h, s, d) position tuples (pages: no b, s their slot dim); out_dims: per output dim, the
   canonical dims (0 b, 1 h, 2 s, 3 d) it holds, outermost first; requires: (size index, value) pairs
   (Program.requires); paged: () or (heads, int32, int64); extras: (dtype, rank) per extra tensor argument;
   patches: (byte offset, kind, extra, dim) per Params word taken per call; bounds: None or
   bounds(B, H, Hkv, Sq, Skv, D, shapes) -> bool. */
static int Decoder_init(Decoder *d, PyObject *args, PyObject *kw) {
    PyObject *tensor_type, *dtype, *ranks, *perms, *out_dims, *params, *pages, *get_stream, *capturing, *grad_enabled,
        *requires, *paged, *extras, *patches, *bounds;
    long long head_dim, value_dim, block_m, block_n, ctas_per_sm, sm_count, min_blocks;
    unsigned long long fn;
    unsigned threads, smem;
    long device;
    double scale;
    if (!PyArg_ParseTuple(args, "OOO!O!O!LLLLKIIldO!O!LLLOOOO!O!O!O!O", &tensor_type, &dtype, &PyTuple_Type, &ranks,
                          &PyTuple_Type, &perms, &PyTuple_Type, &out_dims, &head_dim, &value_dim, &block_m, &block_n,
                          &fn, &threads, &smem, &device, &scale, &PyBytes_Type, &params, &PyBytes_Type, &pages,
                          &ctas_per_sm, &sm_count, &min_blocks, &get_stream, &capturing, &grad_enabled, &PyTuple_Type, &requires,
                          &PyTuple_Type, &paged, &PyTuple_Type, &extras, &PyTuple_Type, &patches, &bounds))
        return -1;
    PyObject *i32 = NULL, *i64 = NULL;
    d->paged = PyTuple_GET_SIZE(paged) != 0;
    if (d->paged && !PyArg_ParseTuple(paged, "LOO", &d->heads, &i32, &i64)) return -1;
    d->nextra = (int)PyTuple_GET_SIZE(extras);
    if (d->nextra > DEC_MAX_EXTRAS) {
        PyErr_SetString(PyExc_ValueError, "extras: at most six tensors");
        return -1;
    }
    PyObject *edt = PyTuple_New(d->nextra);
    if (!edt) return -1;
    for (int i = 0; i < d->nextra; i++) {
        PyObject *dt;
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(extras, i), "Oi", &dt, &d->extra_rank[i]) || d->extra_rank[i] < 0 ||
            d->extra_rank[i] > 4) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "extras: (dtype, rank of 0 to 4)");
            Py_DECREF(edt);
            return -1;
        }
        Py_INCREF(dt);
        PyTuple_SET_ITEM(edt, i, dt);
    }
    Py_XSETREF(d->extra_dtypes, edt);
    d->npatch = (int)PyTuple_GET_SIZE(patches);
    if (d->npatch > DEC_MAX_PATCHES) {
        PyErr_SetString(PyExc_ValueError, "patches: at most 24");
        return -1;
    }
    for (int i = 0; i < d->npatch; i++) {
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(patches, i), "iiii", &d->patch_off[i], &d->patch_kind[i],
                              &d->patch_src[i], &d->patch_dim[i]))
            return -1;
        int src = d->patch_src[i], kind = d->patch_kind[i];
        if (d->patch_off[i] < 0 || d->patch_off[i] % 8 || d->patch_off[i] + 8 > PyBytes_GET_SIZE(params) || kind < 0 ||
            kind > 2 || src < 0 || src >= d->nextra || (kind && (d->patch_dim[i] < 0 || d->patch_dim[i] >= d->extra_rank[src]))) {
            PyErr_SetString(PyExc_ValueError, "patches: a Params word of an extra's pointer, stride or size");
            return -1;
        }
    }
    d->has_key = 0;
    d->nreq = (int)PyTuple_GET_SIZE(requires);
    if (d->nreq > 6) {
        PyErr_SetString(PyExc_ValueError, "requires: at most six sizes");
        return -1;
    }
    for (int i = 0; i < d->nreq; i++) {
        int at;
        long long val;
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(requires, i), "iL", &at, &val)) return -1;
        if (at < 0 || at > 5) {
            PyErr_SetString(PyExc_ValueError, "requires: a size index from 0 to 5");
            return -1;
        }
        d->req_at[i] = at;
        d->req_val[i] = val;
    }
    if (int_items(ranks, d->rank, 3, "ranks") < 0) return -1;
    if (PyTuple_GET_SIZE(perms) != 3) {
        PyErr_SetString(PyExc_ValueError, "perms: one per operand");
        return -1;
    }
    for (int i = 0; i < 3; i++) {
        if (int_items(PyTuple_GET_ITEM(perms, i), d->perm[i], 4, "perm") < 0) return -1;
        if (d->rank[i] < 2 || d->rank[i] > 4) {
            PyErr_SetString(PyExc_ValueError, "an operand of rank 2 to 4");
            return -1;
        }
        for (int j = 0; j < 4; j++)
            if (d->perm[i][j] >= d->rank[i] || (j >= 2 && d->perm[i][j] < 0)) {
                PyErr_SetString(PyExc_ValueError, "a dim position outside the operand");
                return -1;
            }
    }
    d->nout = (int)PyTuple_GET_SIZE(out_dims);
    if (d->nout < 1 || d->nout > 4) {
        PyErr_SetString(PyExc_ValueError, "out_dims: one to four groups");
        return -1;
    }
    int seen[4] = {0, 0, 0, 0};
    for (int g = 0; g < d->nout; g++) {
        PyObject *grp = PyTuple_GET_ITEM(out_dims, g);
        if (!PyTuple_Check(grp) || PyTuple_GET_SIZE(grp) < 1 || PyTuple_GET_SIZE(grp) > 4) {
            PyErr_SetString(PyExc_ValueError, "out_dims: groups of one to four dims");
            return -1;
        }
        d->out_len[g] = (int)PyTuple_GET_SIZE(grp);
        if (int_items(grp, d->out_dims[g], d->out_len[g], "out group") < 0) return -1;
        for (int j = 0; j < d->out_len[g]; j++) {
            int c = d->out_dims[g][j];
            if (c < 0 || c > 3 || seen[c]++) {
                PyErr_SetString(PyExc_ValueError, "out_dims: each canonical dim at most once");
                return -1;
            }
        }
    }
    if (!seen[1] || !seen[2] || !seen[3]) {  /* as Plan.out_layout: h, s and d are always there */
        PyErr_SetString(PyExc_ValueError, "out_dims: h, s and d must be there");
        return -1;
    }
    if (head_dim <= 0 || value_dim <= 0 || block_m <= 0 || block_n <= 0 || ctas_per_sm <= 0 || sm_count <= 0 ||
        min_blocks <= 0) {
        PyErr_SetString(PyExc_ValueError, "sizes must be positive");
        return -1;
    }
    d->head_dim = head_dim;
    d->value_dim = value_dim;
    d->block_m = block_m;
    d->block_n = block_n;
    d->ctas_per_sm = ctas_per_sm;
    d->sm_count = sm_count;
    d->min_blocks = min_blocks;
    d->fn = (void *)(uintptr_t)fn;
    d->threads = threads;
    d->smem = smem;
    d->device = device;
    d->scale = scale;
    PyObject *dev = PyLong_FromLong(device);
    if (!dev) return -1;
    Py_XSETREF(d->device_obj, dev);
#define SET(field, v) do { Py_INCREF(v); Py_XSETREF(d->field, v); } while (0)
    SET(tensor_type, tensor_type);
    SET(dtype, dtype);
    SET(params, params);
    SET(pages, pages);
    SET(get_stream, get_stream);
    SET(capturing, capturing);
    SET(grad_enabled, grad_enabled);
    SET(bounds, bounds);
    if (d->paged) {
        SET(i32, i32);
        SET(i64, i64);
    }
#undef SET
    d->has_scratch = 0;
    return load_driver();
}

/* set_scratch(stream, o_floats, lse_floats, counters, words, keep): the runner's split scratch for `stream`
   (words: the three pointers as FwdArgs' neighbours take them), kept alive by `keep`. */
static PyObject *Decoder_set_scratch(Decoder *d, PyObject *args) {
    unsigned long long stream;
    long long o, l, c;
    PyObject *words, *keep;
    if (!PyArg_ParseTuple(args, "KLLLO!O", &stream, &o, &l, &c, &PyBytes_Type, &words, &keep)) return NULL;
    if (PyBytes_GET_SIZE(words) != 24) {
        PyErr_SetString(PyExc_ValueError, "scratch words: three 8-byte pointers");
        return NULL;
    }
    memcpy(d->s_words, PyBytes_AS_STRING(words), 24);
    d->s_stream = stream;
    d->s_o = o;
    d->s_l = l;
    d->s_counters = c;
    Py_INCREF(keep);
    Py_XSETREF(d->scratch_keep, keep);
    d->has_scratch = 1;
    Py_RETURN_NONE;
}

typedef struct {
    long long shape[4], stride[4];
    unsigned long long ptr;
    int grad;
} Operand;

static int ll_tuple(PyObject *t, long long *out, int n) {
    if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != n) return 0;
    for (int i = 0; i < n; i++) out[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(t, i));
    return PyErr_Occurred() ? -1 : 1;
}

/* 1: read, 0: not a call this path takes, -1: an error. A tensor on the Decoder's device of `rank` dims
   (as a record's match reads them, see), its shape, stride, grad and pointer; its dtype must be `dtype`, or
   where that is NULL one of `alt` and `alt2` (a block table's int32 or int64), given back in *seen_dtype. */
static int read_tensor(Decoder *d, PyObject *t, int rank, PyObject *dtype, PyObject *alt, PyObject *alt2,
                       PyObject **seen_dtype, Operand *o) {
    if (Py_TYPE(t) != (PyTypeObject *)d->tensor_type) return 0;
    Seen s;
    memset(&s, 0, sizeof(s));
    int r = see(t, &s) < 0 ? -1 : s.device == d->device;
    if (r == 1) r = dtype ? s.dtype == dtype : (s.dtype == alt || s.dtype == alt2);
    if (r == 1 && seen_dtype) *seen_dtype = s.dtype;  /* torch's dtypes live as long as torch */
    if (r == 1) r = ll_tuple(s.shape, o->shape, rank);
    if (r == 1) r = ll_tuple(s.stride, o->stride, rank);
    if (r == 1 && pointer(t, &o->ptr) < 0) r = -1;
    o->grad = s.grad;
    forget(&s, 1);
    return r;
}

static int read_operand(Decoder *d, PyObject *t, int rank, Operand *o) {
    return read_tensor(d, t, rank, d->dtype, NULL, NULL, NULL, o);
}

/* Canonical [B, H, S, D] sizes and strides (a missing batch or head dim: size 1, stride 0), as fastpath.canon. */
static void canonical(const Operand *o, const int *perm, long long *n, long long *st) {
    for (int j = 0; j < 4; j++) {
        n[j] = perm[j] < 0 ? 1 : o->shape[perm[j]];
        st[j] = perm[j] < 0 ? 0 : o->stride[perm[j]];
    }
}

static PyObject *ll_shape(const long long *v, int n) {
    PyObject *t = PyTuple_New(n);
    if (!t) return NULL;
    for (int i = 0; i < n; i++) {
        PyObject *x = PyLong_FromLongLong(v[i]);
        if (!x) {
            Py_DECREF(t);
            return NULL;
        }
        PyTuple_SET_ITEM(t, i, x);
    }
    return t;
}

/* The bounds check's yes for this call's sizes and extra shapes: kept for the next calls of the same ones
   (1 holds, 0 does not, -1 an error). */
static int bounds_hold(Decoder *d, const long long *sizes, const Operand *ex) {
    long long key[DEC_KEY_LEN];
    int n = 0;
    for (int i = 0; i < 6; i++) key[n++] = sizes[i];
    for (int i = 0; i < d->nextra; i++)
        for (int j = 0; j < d->extra_rank[i]; j++) key[n++] = ex[i].shape[j];
    if (d->has_key && !memcmp(key, d->key, n * sizeof(long long))) return 1;
    PyObject *shapes = PyTuple_New(d->nextra);
    if (!shapes) return -1;
    for (int i = 0; i < d->nextra; i++) {
        PyObject *t = ll_shape(ex[i].shape, d->extra_rank[i]);
        if (!t) {
            Py_DECREF(shapes);
            return -1;
        }
        PyTuple_SET_ITEM(shapes, i, t);
    }
    PyObject *yes = PyObject_CallFunction(d->bounds, "LLLLLLN", sizes[0], sizes[1], sizes[2], sizes[3], sizes[4],
                                          sizes[5], shapes);
    if (!yes) return -1;
    int ok = PyObject_IsTrue(yes);
    Py_DECREF(yes);
    if (ok == 1) {
        memcpy(d->key, key, n * sizeof(long long));
        d->has_key = 1;
    }
    return ok;
}

/* serve(q, k, v, extras...) or, paged, serve(q, k_pages, v_pages, k_table, v_table, extras...): the output of
   one launch, or None where the Python runner must serve the call. */
static PyObject *Decoder_serve(Decoder *d, PyObject *const *a, Py_ssize_t n) {
    const int nkv = d->paged ? 4 : 2;
    if (n != 1 + nkv + d->nextra) {
        PyErr_SetString(PyExc_TypeError, "serve(q, k, v[, k_table, v_table], extras...)");
        return NULL;
    }
    Operand op[3];
    long long cn[3][4], cs[3][4];
    for (int i = 0; i < 3; i++) {
        int r = read_operand(d, a[i], d->rank[i], &op[i]);
        if (r <= 0) {
            if (r == 0) Py_RETURN_NONE;
            return NULL;
        }
        canonical(&op[i], d->perm[i], cn[i], cs[i]);
        const long long st[4] = {d->paged && i ? op[i].stride[0] : cs[i][0], cs[i][1], cs[i][2], cs[i][3]};
        if (!rows_aligned((long long)op[i].ptr, st)) Py_RETURN_NONE;  /* pages: their own first stride */
    }
    PagedKV pk;
    long long hkv_spec = cn[1][1];
    if (d->paged) {  /* as runner._pages: key s of sequence b is row s % P of page table[b, s / P] */
        Operand t[2];
        PyObject *tdt[2] = {NULL, NULL};
        for (int i = 0; i < 2; i++) {
            int r = read_tensor(d, a[3 + i], 2, NULL, d->i32, d->i64, &tdt[i], &t[i]);
            if (r <= 0) {
                if (r == 0) Py_RETURN_NONE;
                return NULL;
            }
        }
        const long long P = cn[1][2];
        if (tdt[0] != tdt[1] || t[0].shape[0] != t[1].shape[0] || t[0].shape[1] != t[1].shape[1] || cn[2][2] != P ||
            P <= 0 || P >= (1LL << 31) || t[0].shape[1] > (1LL << 40) / P ||  /* page_div's domain */
            !pool_fits(op[1].shape[0], op[2].shape[0]))  /* the runner refuses such pools */
            Py_RETURN_NONE;
        pk = (PagedKV){.k_table = t[0].ptr, .v_table = t[1].ptr, .kt_sb = t[0].stride[0], .kt_sp = t[0].stride[1],
                       .vt_sb = t[1].stride[0], .vt_sp = t[1].stride[1], .k_sp = op[1].stride[0],
                       .v_sp = op[2].stride[0], .k_pages = op[1].shape[0], .v_pages = op[2].shape[0], .page = P,
                       .page_div = page_div(P), .table64 = tdt[0] == d->i64};
        for (int i = 1; i < 3; i++) {  /* the pages' canonical sizes: every sequence's keys in a row */
            cn[i][0] = t[0].shape[0];
            cn[i][2] = t[0].shape[1] * P;
        }
        hkv_spec = d->heads;
    }
    const long long B = cn[0][0], H = cn[0][1], Sq = cn[0][2], D = cn[0][3];
    const long long Hkv = cn[1][1], Skv = cn[1][2];
    if (!shapes_fit(cn[0], cn[1], cn[2], d->head_dim, d->value_dim) || Sq <= 0 || Skv <= 0 || B <= 0)
        Py_RETURN_NONE;  /* shapes the kernel does not take (the runner raises), or no keys or queries (it fills) */
    Operand ex[DEC_MAX_EXTRAS];
    int grad = op[0].grad || op[1].grad || op[2].grad;
    for (int i = 0; i < d->nextra; i++) {
        int r = read_tensor(d, a[1 + nkv + i], d->extra_rank[i], PyTuple_GET_ITEM(d->extra_dtypes, i), NULL, NULL,
                            NULL, &ex[i]);
        if (r <= 0) {
            if (r == 0) Py_RETURN_NONE;
            return NULL;
        }
        grad |= ex[i].grad;
    }
    const long long sizes[6] = {B, H, hkv_spec, Sq, Skv, D};
    for (int i = 0; i < d->nreq; i++)
        if (sizes[d->req_at[i]] != d->req_val[i]) Py_RETURN_NONE;  /* the runner says which size the program holds */
    if (d->bounds != Py_None) {  /* extras read at computed indices: the runner's check, once per shape */
        int ok = bounds_hold(d, sizes, ex);
        if (ok < 0) return NULL;
        if (!ok) Py_RETURN_NONE;
    }
    if (grad) {  /* autograd goes through the spec: the runner says so */
        PyObject *g = PyObject_CallNoArgs(d->grad_enabled);
        if (!g) return NULL;
        int on = PyObject_IsTrue(g);
        Py_DECREF(g);
        if (on) Py_RETURN_NONE;
    }
    if (d->capturing != Py_None) {  /* a graph captures its own scratch (ops.runner._scratch_for) */
        PyObject *c = PyObject_CallNoArgs(d->capturing);
        if (!c) return NULL;
        int cap = PyObject_IsTrue(c);
        Py_DECREF(c);
        if (cap) Py_RETURN_NONE;
    }
    PyObject *st = PyObject_CallOneArg(d->get_stream, d->device_obj);
    if (!st) return NULL;
    unsigned long long stream = PyLong_AsUnsignedLongLong(st);
    Py_DECREF(st);
    if (PyErr_Occurred()) return NULL;

    const long long row_tiles = ((H / Hkv) * Sq + d->block_m - 1) / d->block_m;
    const long long n_blk = (Skv + d->block_n - 1) / d->block_n;
    const long long ctas = Hkv * row_tiles * B;
    long long n_split, per;
    decode_split(ctas, n_blk, d->sm_count, d->ctas_per_sm, d->min_blocks, &n_split, &per);
    static const unsigned char no_scratch[24] = {0};
    const unsigned char *words = no_scratch;
    if (n_split > 1) {
        const long long rows = B * H * Sq * n_split;
        if (!d->has_scratch || d->s_stream != stream || d->s_o < rows * d->value_dim || d->s_l < rows * 2 ||
            d->s_counters < ctas)
            Py_RETURN_NONE;  /* the Python runner makes a larger one and hands it over */
        words = d->s_words;
    }
    if (Hkv * row_tiles > 65535 || B > 65535 || n_split > 0x7fffffffLL) Py_RETURN_NONE;

    /* the output: contiguous in the spec's layout (Plan.out_layout) */
    const long long ext[4] = {B, H, Sq, d->value_dim};
    long long ostride[4] = {0, 0, 0, 0}, oshape[4], ostrides_flat[4], acc = 1;
    for (int g = d->nout - 1; g >= 0; g--) {
        oshape[g] = 1;
        for (int j = d->out_len[g] - 1; j >= 0; j--) {
            int c = d->out_dims[g][j];
            ostride[c] = acc;
            acc *= ext[c];
            oshape[g] *= ext[c];
        }
    }
    for (int g = 0; g < d->nout; g++) ostrides_flat[g] = ostride[d->out_dims[g][d->out_len[g] - 1]];
    PyObject *shape = ll_shape(oshape, d->nout), *strides = shape ? ll_shape(ostrides_flat, d->nout) : NULL;
    if (!strides) {
        Py_XDECREF(shape);
        return NULL;
    }
    PyObject *call[3] = {a[0], shape, strides};
    PyObject *out = PyObject_VectorcallMethod(s_new_empty_strided, call, 3, NULL);
    Py_DECREF(shape);
    Py_DECREF(strides);
    if (!out) return NULL;
    unsigned long long out_ptr;
    if (pointer(out, &out_ptr) < 0) {
        Py_DECREF(out);
        return NULL;
    }

    /* the kernel's parameters, each put where host_rules.h says the kernel takes it (DEC_*): FwdArgs,
       Params, the three scratch words, the chunk of keys per split, the pages (zeros where unpaged) */
    _Static_assert(DEC_NPARAMS == 7, "the Decoder fills seven decode kernel parameters");
    _Alignas(64) unsigned char buf[MAX_PARAM_BYTES];
    const FwdArgs fwd = {.q = op[0].ptr, .k = op[1].ptr, .v = op[2].ptr, .o = out_ptr, .lse = 0,
                         .q_sb = cs[0][0], .q_sh = cs[0][1], .q_ss = cs[0][2],
                         .k_sb = cs[1][0], .k_sh = cs[1][1], .k_ss = cs[1][2],
                         .v_sb = cs[2][0], .v_sh = cs[2][1], .v_ss = cs[2][2],
                         .o_sb = ostride[0], .o_sh = ostride[1], .o_ss = ostride[2],
                         .B = B, .Hq = H, .Hkv = Hkv, .Sq = Sq, .Skv = Skv, .scale = d->scale};
    const long long chunk = per * d->block_n;
    const void *src[DEC_NPARAMS];
    size_t len[DEC_NPARAMS];
    src[DEC_A] = &fwd, len[DEC_A] = sizeof(fwd);
    src[DEC_P] = PyBytes_AS_STRING(d->params), len[DEC_P] = (size_t)PyBytes_GET_SIZE(d->params);
    src[DEC_PART_O] = words, len[DEC_PART_O] = 8;
    src[DEC_PART_LSE] = words + 8, len[DEC_PART_LSE] = 8;
    src[DEC_COUNTERS] = words + 16, len[DEC_COUNTERS] = 8;
    src[DEC_CHUNK] = &chunk, len[DEC_CHUNK] = 8;
    src[DEC_PG] = d->paged ? (const void *)&pk : PyBytes_AS_STRING(d->pages);
    len[DEC_PG] = d->paged ? sizeof(pk) : (size_t)PyBytes_GET_SIZE(d->pages);
    void *kparams[DEC_NPARAMS];
    size_t off = 0;
    for (int i = 0; i < DEC_NPARAMS; i++) {
        if (off + len[i] > MAX_PARAM_BYTES) {
            Py_DECREF(out);
            Py_RETURN_NONE;
        }
        memcpy(buf + off, src[i], len[i]);
        kparams[i] = buf + off;
        off = (off + len[i] + 63) & ~(size_t)63;
    }
    for (int i = 0; i < d->npatch; i++) {  /* the extras' words of Params */
        const Operand *x = &ex[d->patch_src[i]];
        const long long v = d->patch_kind[i] == 0 ? (long long)x->ptr
                            : d->patch_kind[i] == 1 ? x->stride[d->patch_dim[i]] : x->shape[d->patch_dim[i]];
        memcpy((unsigned char *)kparams[DEC_P] + d->patch_off[i], &v, 8);
    }
    CUresult rc = cu_launch(d->fn, (unsigned)n_split, (unsigned)(Hkv * row_tiles), (unsigned)B, d->threads, 1, 1,
                            d->smem, (void *)(uintptr_t)stream, kparams, NULL);
    out = after_launch(rc, out);
    if (out && out != Py_None) d->hits++;
    return out;
}

static PyObject *Decoder_hits(Decoder *d, void *unused) { return PyLong_FromSsize_t(d->hits); }

static PyGetSetDef Decoder_getset[] = {
    {"hits", (getter)Decoder_hits, NULL, "calls this decoder launched", NULL},
    {NULL},
};

static PyMethodDef Decoder_methods[] = {
    {"serve", (PyCFunction)(void (*)(void))Decoder_serve, METH_FASTCALL, "the output of one launch, or None"},
    {"set_scratch", (PyCFunction)Decoder_set_scratch, METH_VARARGS, "the runner's split scratch for a stream"},
    {NULL},
};

static PyTypeObject DecoderType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "torch_cubridge._hotpath.Decoder",
    .tp_basicsize = sizeof(Decoder),
    .tp_dealloc = (destructor)Decoder_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "the decode kernel's launch for any sizes",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Decoder_init,
    .tp_getset = Decoder_getset,
    .tp_methods = Decoder_methods,
};
