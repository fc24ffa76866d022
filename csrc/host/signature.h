/* The call signature in C: capture/signature.py's call_signature, key for key (tests/test_signature_c.py
   holds the two equal), for the calls the host fast path cannot replay (keywords, module arguments, a
   growing cache: the transformers drop-in's), where building the key in Python was half of the Python
   path. The rule per argument is signature.py's _meta; the kinds are its _KIND table, filled by its
   _kind, and an object kept by identity is its _same's. Included by hotpath.c. */

static PyObject *sig_kinds, *sig_kind_fn, *sig_same, *sig_one, *s_name;
static long sig_tensor, sig_plain, sig_seq; /* every other kind is kept by identity */

static PyObject *configure_signature(PyObject *self, PyObject *args) {
    PyObject *kinds, *kind_fn, *same, *one;
    if (!PyArg_ParseTuple(args, "O!OOO(lll)", &PyDict_Type, &kinds, &kind_fn, &same, &one, &sig_tensor, &sig_plain,
                          &sig_seq))
        return NULL;
    Py_XSETREF(sig_kinds, Py_NewRef(kinds));
    Py_XSETREF(sig_kind_fn, Py_NewRef(kind_fn));
    Py_XSETREF(sig_same, Py_NewRef(same));
    Py_XSETREF(sig_one, Py_NewRef(one));
    if (!s_name) s_name = PyUnicode_InternFromString("__name__");
    Py_RETURN_NONE;
}

static PyObject *meta(PyObject *v);

/* (dtype, get_device(), which dims are 1) */
static PyObject *tensor_meta(PyObject *v) {
    PyObject *dtype = PyObject_GetAttr(v, s_dtype);
    PyObject *dev = dtype ? PyObject_CallMethodNoArgs(v, s_get_device) : NULL;
    PyObject *shape = dev ? PyObject_GetAttr(v, s_shape) : NULL;
    PyObject *ones = NULL;
    if (shape && PyTuple_Check(shape)) {
        Py_ssize_t n = PyTuple_GET_SIZE(shape);
        ones = PyTuple_New(n);
        for (Py_ssize_t i = 0; ones && i < n; i++) {
            PyObject *d = PyTuple_GET_ITEM(shape, i), *b;
            if (PyLong_CheckExact(d)) {
                int overflow = 0;
                long long x = PyLong_AsLongLongAndOverflow(d, &overflow);
                b = Py_NewRef(!overflow && x == 1 ? Py_True : Py_False);
            } else {
                b = PyObject_CallOneArg(sig_one, d); /* a symbolic size: (1).__eq__ as Python calls it */
            }
            if (!b) Py_CLEAR(ones);
            else PyTuple_SET_ITEM(ones, i, b);
        }
    } else if (shape) {
        PyErr_SetString(PyExc_TypeError, "a tensor's shape is not a tuple");
    }
    PyObject *out = ones ? PyTuple_Pack(3, dtype, dev, ones) : NULL;
    Py_XDECREF(dtype);
    Py_XDECREF(dev);
    Py_XDECREF(shape);
    Py_XDECREF(ones);
    return out;
}

/* (type(v).__name__, _same(v)) */
static PyObject *identity_meta(PyObject *v) {
    PyObject *name = PyObject_GetAttr((PyObject *)Py_TYPE(v), s_name);
    PyObject *same = name ? PyObject_CallOneArg(sig_same, v) : NULL;
    PyObject *out = same ? PyTuple_Pack(2, name, same) : NULL;
    Py_XDECREF(name);
    Py_XDECREF(same);
    return out;
}

static PyObject *meta(PyObject *v) {
    PyObject *k = PyDict_GetItemWithError(sig_kinds, (PyObject *)Py_TYPE(v)); /* borrowed */
    long kind;
    if (k) {
        kind = PyLong_AsLong(k);
    } else {
        if (PyErr_Occurred()) return NULL;
        PyObject *r = PyObject_CallOneArg(sig_kind_fn, (PyObject *)Py_TYPE(v));
        if (!r) return NULL;
        kind = PyLong_AsLong(r);
        Py_DECREF(r);
    }
    if (kind == -1 && PyErr_Occurred()) return NULL;
    if (kind == sig_tensor) return tensor_meta(v);
    if (kind == sig_plain) return Py_NewRef(v);
    if (kind == sig_seq) {
        PyObject *seq = PySequence_Fast(v, "a sequence");
        if (!seq) return NULL;
        Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
        PyObject *out = PyTuple_New(n);
        for (Py_ssize_t i = 0; out && i < n; i++) {
            PyObject *m = meta(PySequence_Fast_GET_ITEM(seq, i));
            if (!m) Py_CLEAR(out);
            else PyTuple_SET_ITEM(out, i, m);
        }
        Py_DECREF(seq);
        return out;
    }
    return identity_meta(v); /* a module, or any other object: by identity */
}

/* signature(args, kwargs): the key of one call (kwargs None or a dict, by sorted name) */
static PyObject *signature(PyObject *self, PyObject *const *a, Py_ssize_t n) {
    if (n != 2 || !PyTuple_Check(a[0]) || (a[1] != Py_None && !PyDict_Check(a[1]))) {
        PyErr_SetString(PyExc_TypeError, "signature(args: tuple, kwargs: dict | None)");
        return NULL;
    }
    if (!sig_kinds) {
        PyErr_SetString(PyExc_RuntimeError, "configure_signature was not called");
        return NULL;
    }
    PyObject *args = a[0], *kwargs = a[1] == Py_None ? NULL : a[1];
    Py_ssize_t na = PyTuple_GET_SIZE(args), nk = kwargs ? PyDict_GET_SIZE(kwargs) : 0;
    PyObject *names = nk ? PyDict_Keys(kwargs) : NULL;
    if (nk && (!names || PyList_Sort(names) < 0)) {
        Py_XDECREF(names);
        return NULL;
    }
    PyObject *key = PyTuple_New(na + nk);
    for (Py_ssize_t i = 0; key && i < na; i++) {
        PyObject *m = meta(PyTuple_GET_ITEM(args, i));
        if (!m) Py_CLEAR(key);
        else PyTuple_SET_ITEM(key, i, m);
    }
    for (Py_ssize_t i = 0; key && i < nk; i++) {
        PyObject *name = PyList_GET_ITEM(names, i);
        PyObject *v = PyDict_GetItemWithError(kwargs, name); /* borrowed */
        PyObject *m = v ? meta(v) : NULL;
        PyObject *pair = m ? PyTuple_Pack(2, name, m) : NULL;
        Py_XDECREF(m);
        if (!pair) {
            if (!v && !PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "kwargs changed during the call");
            Py_CLEAR(key);
        } else {
            PyTuple_SET_ITEM(key, na + i, pair);
        }
    }
    Py_XDECREF(names);
    return key;
}
