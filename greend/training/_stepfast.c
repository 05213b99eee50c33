/* The hot path of greend.training.step.Step in C: construction, __enter__, loss()
 * and __exit__, which run on the training thread at every step.
 *
 * It does what the pure-Python class _PyStep in step.py does, line for line (that
 * class is the reference, and the fallback where this module is not built): read the
 * callback's pending directive, take the precision, look the batch's shape up in the
 * FLOP cache, read the clock, hold the loss, and put the ended step on the callback's
 * list. Everything rarer (a directive to apply, a rank agreement, a FLOP count, the
 * batched loss read) calls back into the Python methods that do it.
 *
 * The clock is whatever step.py hands to set_hooks() (time.monotonic; tests may hand
 * another), so both implementations read the same clock.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

typedef struct {
    PyObject_HEAD
    PyObject *cb;
    PyObject *index;
    PyObject *samples;
    PyObject *tokens;
    PyObject *flops;
    PyObject *shape_key;
    double t0_s;
    double t1_s;
    PyObject *loss_value;      /* _loss */
    char nonfinite;            /* _nonfinite */
    PyObject *nonfinite_cause; /* _nonfinite_cause */
    char counting;             /* _counting */
    char scaled;               /* _scaled */
    PyObject *precision;
    char shape_guessed;        /* _shape_guessed */
    PyObject *forward_signature;
    PyObject *spike_reason;
    PyObject *pending;
    PyObject *raw;
} StepObject;

static PyTypeObject StepBaseType;

/* Set once by set_hooks(). */
static PyObject *g_clock = NULL;        /* time.monotonic */
static PyTypeObject *g_tensor = NULL;   /* torch.Tensor */
static PyObject *g_fp32 = NULL;         /* "fp32" */
static PyObject *g_cause_loss = NULL;   /* "loss" */

/* Interned attribute and method names. */
static PyObject *s_requested, *s_seen_request, *s_take_request, *s_agreeing, *s_enter_agreeing,
    *s_precision, *s_flop_cache, *s_plan_flops, *s_end_flops, *s_ended, *s_judge_by,
    *s_judge_within_s, *s_judge_every, *s_drain, *s_max_unjudged, *s_keep, *s_loss_other, *s_get;
static PyObject *g_keep_kwnames = NULL; /* ("keep",) */

/* The object fields, once: traverse and clear go over the same list. */
#define STEP_OBJECT_FIELDS(X)                                                                \
    X(cb) X(index) X(samples) X(tokens) X(flops) X(shape_key) X(loss_value) X(nonfinite_cause) \
    X(precision) X(forward_signature) X(spike_reason) X(pending) X(raw)

static int
step_traverse(StepObject *self, visitproc visit, void *arg)
{
    /* (A heap subclass's own traverse visits its type: a static base must not.) */
#define VISIT_FIELD(f) Py_VISIT(self->f);
    STEP_OBJECT_FIELDS(VISIT_FIELD)
#undef VISIT_FIELD
    return 0;
}

static int
step_clear(StepObject *self)
{
#define CLEAR_FIELD(f) Py_CLEAR(self->f);
    STEP_OBJECT_FIELDS(CLEAR_FIELD)
#undef CLEAR_FIELD
    return 0;
}

static void
step_dealloc(StepObject *self)
{
    /* (For a Python subclass, subtype_dealloc calls this and then drops its reference
     * to the heap type itself.) */
    PyObject_GC_UnTrack(self);
    step_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Fill a fresh object: the fields _PyStep.__init__ sets. Steals nothing. */
static void
step_fill(StepObject *self, PyObject *cb, PyObject *index, PyObject *samples, PyObject *tokens,
          PyObject *shape_key, PyObject *flops)
{
    Py_INCREF(cb);
    self->cb = cb;
    Py_INCREF(index);
    self->index = index;
    Py_INCREF(samples);
    self->samples = samples;
    Py_INCREF(tokens);
    self->tokens = tokens;
    Py_INCREF(shape_key);
    self->shape_key = shape_key;
    Py_INCREF(flops);
    self->flops = flops;
    self->t0_s = 0.0;
    self->t1_s = 0.0;
    Py_INCREF(Py_None);
    self->loss_value = Py_None;
    self->nonfinite = 0;
    Py_INCREF(g_cause_loss);
    self->nonfinite_cause = g_cause_loss;
    self->counting = 0;
    self->scaled = 0;
    Py_INCREF(g_fp32);
    self->precision = g_fp32;
    self->shape_guessed = 0;
    Py_INCREF(Py_None);
    self->forward_signature = Py_None;
    Py_INCREF(Py_None);
    self->spike_reason = Py_None;
    Py_INCREF(Py_None);
    self->pending = Py_None;
    Py_INCREF(Py_None);
    self->raw = Py_None;
}

static int
step_init(StepObject *self, PyObject *args, PyObject *kwds)
{
    PyObject *cb, *index, *samples, *tokens, *shape_key, *flops;
    static char *kwlist[] = {"cb", "index", "samples", "tokens", "shape_key", "flops", NULL};
    if (g_clock == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "greend.training._stepfast: set_hooks() was not called");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOOOO", kwlist, &cb, &index, &samples, &tokens,
                                     &shape_key, &flops)) {
        return -1;
    }
    step_clear(self);
    step_fill(self, cb, index, samples, tokens, shape_key, flops);
    return 0;
}

/* new_step(cls, cb, index, samples, tokens, shape_key, flops): cls(...) without the
 * generic type call (what GreenCallback.step() calls at every step). */
static PyObject *
new_step(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 7) {
        PyErr_Format(PyExc_TypeError, "new_step() takes 7 arguments (%zd given)", nargs);
        return NULL;
    }
    if (g_clock == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "greend.training._stepfast: set_hooks() was not called");
        return NULL;
    }
    PyTypeObject *cls = (PyTypeObject *)args[0];
    if (!PyType_Check(args[0]) || !PyType_IsSubtype(cls, &StepBaseType)) {
        PyErr_SetString(PyExc_TypeError, "new_step(): cls must be a subclass of StepBase");
        return NULL;
    }
    StepObject *self = (StepObject *)cls->tp_alloc(cls, 0);
    if (self == NULL) {
        return NULL;
    }
    step_fill(self, args[1], args[2], args[3], args[4], args[5], args[6]);
    return (PyObject *)self;
}

static int
read_clock(double *out)
{
    PyObject *t = PyObject_CallNoArgs(g_clock);
    if (t == NULL) {
        return -1;
    }
    *out = PyFloat_AsDouble(t);
    Py_DECREF(t);
    if (*out == -1.0 && PyErr_Occurred()) {
        return -1;
    }
    return 0;
}

/* A field a step needs, NULL once deleted from Python: AttributeError, as a slot gives. */
static int
need(PyObject *field, const char *name)
{
    if (field == NULL) {
        PyErr_Format(PyExc_AttributeError, "step object has no attribute '%s'", name);
        return -1;
    }
    return 0;
}

static PyObject *
step_enter(StepObject *self, PyObject *Py_UNUSED(ignored))
{
    if (need(self->cb, "_cb") < 0 || need(self->flops, "flops") < 0) {
        return NULL;
    }
    /* A reference of our own: the Python code called below could replace self->cb. */
    PyObject *cb = Py_NewRef(self->cb);
    PyObject *result = NULL;
    /* A directive from the daemon (written by the sender thread: read once). */
    PyObject *requested = PyObject_GetAttr(cb, s_requested);
    if (requested == NULL) {
        goto done;
    }
    PyObject *seen = PyObject_GetAttr(cb, s_seen_request);
    if (seen == NULL) {
        Py_DECREF(requested);
        goto done;
    }
    int changed = requested != seen;
    Py_DECREF(seen);
    if (changed) {
        PyObject *r = PyObject_CallMethodOneArg(cb, s_take_request, requested);
        if (r == NULL) {
            Py_DECREF(requested);
            goto done;
        }
        Py_DECREF(r);
    }
    Py_DECREF(requested);
    /* Ranks agreeing on their precision every sync_every steps. */
    PyObject *agreeing = PyObject_GetAttr(cb, s_agreeing);
    if (agreeing == NULL) {
        goto done;
    }
    int agree = PyObject_IsTrue(agreeing);
    Py_DECREF(agreeing);
    if (agree < 0) {
        goto done;
    }
    if (agree) {
        PyObject *r = PyObject_CallMethodNoArgs(cb, s_enter_agreeing);
        if (r == NULL) {
            goto done;
        }
        Py_DECREF(r);
    }
    PyObject *precision = PyObject_GetAttr(cb, s_precision);
    if (precision == NULL) {
        goto done;
    }
    Py_XSETREF(self->precision, precision);
    if (self->flops == NULL || self->flops == Py_None) {
        /* The common case inline: a shape counted already. */
        PyObject *flops = NULL;
        PyObject *key = self->shape_key;
        if (key != NULL && key != Py_None) {
            Py_INCREF(key);
            PyObject *cache = PyObject_GetAttr(cb, s_flop_cache);
            if (cache == NULL) {
                Py_DECREF(key);
                goto done;
            }
            if (PyDict_CheckExact(cache)) {
                flops = Py_XNewRef(PyDict_GetItemWithError(cache, key)); /* (borrowed: own it) */
            } else {
                flops = PyObject_CallMethodOneArg(cache, s_get, key);
            }
            if (flops == Py_None) {
                Py_CLEAR(flops); /* (a None entry is a miss, as in Python) */
            }
            Py_DECREF(cache);
            Py_DECREF(key);
            if (flops == NULL && PyErr_Occurred()) {
                if (!PyErr_ExceptionMatches(PyExc_TypeError)) {
                    goto done;
                }
                PyErr_Clear(); /* an unhashable shape_key=: _plan_flops makes it one */
            }
        }
        if (flops == NULL) {
            PyObject *r = PyObject_CallMethodOneArg(cb, s_plan_flops, (PyObject *)self);
            if (r == NULL) {
                goto done;
            }
            Py_DECREF(r);
        } else {
            Py_XSETREF(self->flops, flops);
        }
    }
    if (read_clock(&self->t0_s) < 0) {
        goto done;
    }
    result = Py_NewRef((PyObject *)self);
done:
    Py_DECREF(cb);
    return result;
}

/* cb.<name> as a double (-1 with an exception set on failure). */
static int
attr_double(PyObject *cb, PyObject *name, double *out)
{
    PyObject *v = PyObject_GetAttr(cb, name);
    if (v == NULL) {
        return -1;
    }
    *out = PyFloat_AsDouble(v);
    Py_DECREF(v);
    return (*out == -1.0 && PyErr_Occurred()) ? -1 : 0;
}

static PyObject *
step_exit(StepObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "__exit__() takes 3 arguments (%zd given)", nargs);
        return NULL;
    }
    double t1;
    if (read_clock(&t1) < 0) {
        return NULL;
    }
    PyObject *exc_type = args[0];
    if (self->shape_guessed || self->counting) {
        PyObject *r = PyObject_CallMethodOneArg((PyObject *)self, s_end_flops,
                                                exc_type == Py_None ? Py_True : Py_False);
        if (r == NULL) {
            return NULL;
        }
        Py_DECREF(r);
    }
    if (exc_type != Py_None) {
        Py_RETURN_FALSE; /* the user's error: not ours to swallow, and no record */
    }
    self->t1_s = t1;
    if (need(self->cb, "_cb") < 0) {
        return NULL;
    }
    /* Read, judged and recorded with the next batch of ended steps (GreenCallback._drain). */
    PyObject *cb = Py_NewRef(self->cb);
    PyObject *result = NULL;
    PyObject *ended = PyObject_GetAttr(cb, s_ended);
    if (ended == NULL) {
        goto done;
    }
    if (!PyList_Check(ended)) {
        Py_DECREF(ended);
        PyErr_SetString(PyExc_TypeError, "GreenCallback._ended must be a list");
        goto done;
    }
    if (PyList_GET_SIZE(ended) == 0) {
        double w;
        PyObject *by = NULL;
        if (attr_double(cb, s_judge_within_s, &w) < 0 || (by = PyFloat_FromDouble(t1 + w)) == NULL ||
            PyObject_SetAttr(cb, s_judge_by, by) < 0) {
            Py_XDECREF(by);
            Py_DECREF(ended);
            goto done;
        }
        Py_DECREF(by);
    }
    if (PyList_Append(ended, (PyObject *)self) < 0) {
        Py_DECREF(ended);
        goto done;
    }
    Py_ssize_t n = PyList_GET_SIZE(ended);
    Py_DECREF(ended);
    double every, by;
    if (attr_double(cb, s_judge_every, &every) < 0) {
        goto done;
    }
    int drain = (double)n >= every;
    if (!drain) {
        if (attr_double(cb, s_judge_by, &by) < 0) {
            goto done;
        }
        drain = t1 >= by;
    }
    if (drain) {
        PyObject *keep = PyObject_GetAttr(cb, s_max_unjudged);
        if (keep == NULL) {
            goto done;
        }
        PyObject *meth = PyObject_GetAttr(cb, s_drain);
        if (meth == NULL) {
            Py_DECREF(keep);
            goto done;
        }
        PyObject *callargs[1] = {keep};
        PyObject *r = PyObject_Vectorcall(meth, callargs, 0, g_keep_kwnames);
        Py_DECREF(meth);
        Py_DECREF(keep);
        if (r == NULL) {
            goto done;
        }
        Py_DECREF(r);
    }
    result = Py_NewRef(Py_False);
done:
    Py_DECREF(cb);
    return result;
}

/* loss(loss): hold a tensor; anything else goes to the Python method _loss_other. */
static PyObject *
step_loss(StepObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    PyObject *loss;
    Py_ssize_t nkw = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);
    if (nargs == 1 && nkw == 0) {
        loss = args[0];
    } else if (nargs == 0 && nkw == 1 &&
               PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(kwnames, 0), "loss") == 0) {
        loss = args[0];
    } else {
        PyErr_SetString(PyExc_TypeError, "loss() takes one argument: loss");
        return NULL;
    }
    int is_tensor = 0;
    if (g_tensor != NULL) {
        is_tensor = Py_TYPE(loss) == g_tensor ? 1 : PyObject_IsInstance(loss, (PyObject *)g_tensor);
        if (is_tensor < 0) {
            return NULL;
        }
    }
    if (is_tensor) {
        Py_XSETREF(self->raw, Py_NewRef(loss));
        Py_RETURN_NONE;
    }
    return PyObject_CallMethodOneArg((PyObject *)self, s_loss_other, loss);
}

static PyMethodDef step_methods[] = {
    {"__enter__", (PyCFunction)step_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)(void (*)(void))step_exit, METH_FASTCALL, NULL},
    {"loss", (PyCFunction)(void (*)(void))step_loss, METH_FASTCALL | METH_KEYWORDS,
     "loss($self, /, loss)\n--\n\nReport this step's loss (a tensor or a number): see the Step class."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef step_members[] = {
    {"_cb", T_OBJECT_EX, offsetof(StepObject, cb), 0, NULL},
    {"index", T_OBJECT_EX, offsetof(StepObject, index), 0, NULL},
    {"samples", T_OBJECT_EX, offsetof(StepObject, samples), 0, NULL},
    {"tokens", T_OBJECT_EX, offsetof(StepObject, tokens), 0, NULL},
    {"flops", T_OBJECT_EX, offsetof(StepObject, flops), 0, NULL},
    {"_shape_key", T_OBJECT_EX, offsetof(StepObject, shape_key), 0, NULL},
    {"t0_s", T_DOUBLE, offsetof(StepObject, t0_s), 0, NULL},
    {"t1_s", T_DOUBLE, offsetof(StepObject, t1_s), 0, NULL},
    {"_loss", T_OBJECT_EX, offsetof(StepObject, loss_value), 0, NULL},
    {"_nonfinite", T_BOOL, offsetof(StepObject, nonfinite), 0, NULL},
    {"_nonfinite_cause", T_OBJECT_EX, offsetof(StepObject, nonfinite_cause), 0, NULL},
    {"_counting", T_BOOL, offsetof(StepObject, counting), 0, NULL},
    {"_scaled", T_BOOL, offsetof(StepObject, scaled), 0, NULL},
    {"precision", T_OBJECT_EX, offsetof(StepObject, precision), 0, NULL},
    {"_shape_guessed", T_BOOL, offsetof(StepObject, shape_guessed), 0, NULL},
    {"_forward_signature", T_OBJECT_EX, offsetof(StepObject, forward_signature), 0, NULL},
    {"_spike_reason", T_OBJECT_EX, offsetof(StepObject, spike_reason), 0, NULL},
    {"_pending", T_OBJECT_EX, offsetof(StepObject, pending), 0, NULL},
    {"_raw", T_OBJECT_EX, offsetof(StepObject, raw), 0, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject StepBaseType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "greend.training._stepfast.StepBase",
    .tp_basicsize = sizeof(StepObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The per-step hot path of greend.training.step.Step (see _stepfast.c).",
    .tp_traverse = (traverseproc)step_traverse,
    .tp_clear = (inquiry)step_clear,
    .tp_dealloc = (destructor)step_dealloc,
    .tp_methods = step_methods,
    .tp_members = step_members,
    .tp_init = (initproc)step_init,
    .tp_new = PyType_GenericNew,
};

/* set_hooks(clock, tensor_type): the clock steps read and the tensor type loss() holds. */
static PyObject *
set_hooks(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "set_hooks() takes 2 arguments (%zd given)", nargs);
        return NULL;
    }
    if (!PyCallable_Check(args[0]) || !PyType_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "set_hooks(clock, tensor_type): a callable and a type");
        return NULL;
    }
    Py_INCREF(args[0]);
    Py_XSETREF(g_clock, args[0]);
    Py_INCREF(args[1]);
    Py_XSETREF(g_tensor, (PyTypeObject *)args[1]);
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"new_step", (PyCFunction)(void (*)(void))new_step, METH_FASTCALL,
     "new_step(cls, cb, index, samples, tokens, shape_key, flops)\n--\n\nA new step of class cls."},
    {"set_hooks", (PyCFunction)(void (*)(void))set_hooks, METH_FASTCALL,
     "set_hooks(clock, tensor_type)\n--\n\nThe clock steps read and the tensor type loss() holds."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef stepfast_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "greend.training._stepfast",
    .m_doc = "The per-step hot path of greend.training.step in C.",
    .m_size = -1,
    .m_methods = module_methods,
};

#define INTERN(var, text)                                 \
    do {                                                  \
        var = PyUnicode_InternFromString(text);           \
        if (var == NULL) {                                \
            return NULL;                                  \
        }                                                 \
    } while (0)

PyMODINIT_FUNC
PyInit__stepfast(void)
{
    INTERN(s_requested, "_requested");
    INTERN(s_seen_request, "_seen_request");
    INTERN(s_take_request, "_take_request");
    INTERN(s_agreeing, "_agreeing");
    INTERN(s_enter_agreeing, "_enter_agreeing");
    INTERN(s_precision, "_precision");
    INTERN(s_flop_cache, "_flop_cache");
    INTERN(s_plan_flops, "_plan_flops");
    INTERN(s_end_flops, "_end_flops");
    INTERN(s_ended, "_ended");
    INTERN(s_judge_by, "_judge_by");
    INTERN(s_judge_within_s, "_judge_within_s");
    INTERN(s_judge_every, "_judge_every");
    INTERN(s_drain, "_drain");
    INTERN(s_max_unjudged, "_max_unjudged");
    INTERN(s_keep, "keep");
    INTERN(s_loss_other, "_loss_other");
    INTERN(s_get, "get");
    g_keep_kwnames = PyTuple_Pack(1, s_keep);
    if (g_keep_kwnames == NULL) {
        return NULL;
    }
    INTERN(g_fp32, "fp32");
    INTERN(g_cause_loss, "loss");
    if (PyType_Ready(&StepBaseType) < 0) {
        return NULL;
    }
    PyObject *m = PyModule_Create(&stepfast_module);
    if (m == NULL) {
        return NULL;
    }
    Py_INCREF(&StepBaseType);
    if (PyModule_AddObject(m, "StepBase", (PyObject *)&StepBaseType) < 0) {
        Py_DECREF(&StepBaseType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
