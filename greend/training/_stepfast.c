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
    *s_judge_within_s, *s_judge_every, *s_drain, *s_max_unjudged, *s_keep, *s_loss_other;

static int
step_traverse(StepObject *self, visitproc visit, void *arg)
{
    /* (A heap subclass's own traverse visits its type: a static base must not.) */
    Py_VISIT(self->cb);
    Py_VISIT(self->index);
    Py_VISIT(self->samples);
    Py_VISIT(self->tokens);
    Py_VISIT(self->flops);
    Py_VISIT(self->shape_key);
    Py_VISIT(self->loss_value);
    Py_VISIT(self->nonfinite_cause);
    Py_VISIT(self->precision);
    Py_VISIT(self->forward_signature);
    Py_VISIT(self->spike_reason);
    Py_VISIT(self->pending);
    Py_VISIT(self->raw);
    return 0;
}

static int
step_clear(StepObject *self)
{
    Py_CLEAR(self->cb);
    Py_CLEAR(self->index);
    Py_CLEAR(self->samples);
    Py_CLEAR(self->tokens);
    Py_CLEAR(self->flops);
    Py_CLEAR(self->shape_key);
    Py_CLEAR(self->loss_value);
    Py_CLEAR(self->nonfinite_cause);
    Py_CLEAR(self->precision);
    Py_CLEAR(self->forward_signature);
    Py_CLEAR(self->spike_reason);
    Py_CLEAR(self->pending);
    Py_CLEAR(self->raw);
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

static PyObject *
step_enter(StepObject *self, PyObject *Py_UNUSED(ignored))
{
    PyObject *cb = self->cb;
    /* A directive from the daemon (written by the sender thread: read once). */
    PyObject *requested = PyObject_GetAttr(cb, s_requested);
    if (requested == NULL) {
        return NULL;
    }
    PyObject *seen = PyObject_GetAttr(cb, s_seen_request);
    if (seen == NULL) {
        Py_DECREF(requested);
        return NULL;
    }
    Py_DECREF(seen); /* (only its identity is needed: cb holds it) */
    if (requested != seen) {
        PyObject *r = PyObject_CallMethodOneArg(cb, s_take_request, requested);
        if (r == NULL) {
            Py_DECREF(requested);
            return NULL;
        }
        Py_DECREF(r);
    }
    Py_DECREF(requested);
    /* Ranks agreeing on their precision every sync_every steps. */
    PyObject *agreeing = PyObject_GetAttr(cb, s_agreeing);
    if (agreeing == NULL) {
        return NULL;
    }
    int agree = PyObject_IsTrue(agreeing);
    Py_DECREF(agreeing);
    if (agree < 0) {
        return NULL;
    }
    if (agree) {
        PyObject *r = PyObject_CallMethodNoArgs(cb, s_enter_agreeing);
        if (r == NULL) {
            return NULL;
        }
        Py_DECREF(r);
    }
    PyObject *precision = PyObject_GetAttr(cb, s_precision);
    if (precision == NULL) {
        return NULL;
    }
    Py_SETREF(self->precision, precision);
    if (self->flops == Py_None) {
        /* The common case inline: a shape counted already. */
        PyObject *flops = NULL;
        if (self->shape_key != Py_None) {
            PyObject *cache = PyObject_GetAttr(cb, s_flop_cache);
            if (cache == NULL) {
                return NULL;
            }
            if (PyDict_CheckExact(cache)) {
                flops = PyDict_GetItemWithError(cache, self->shape_key); /* borrowed */
                Py_XINCREF(flops);
            } else {
                flops = PyObject_CallMethod(cache, "get", "O", self->shape_key);
                if (flops == Py_None) {
                    Py_CLEAR(flops);
                }
            }
            Py_DECREF(cache);
            if (flops == NULL && PyErr_Occurred()) {
                if (!PyErr_ExceptionMatches(PyExc_TypeError)) {
                    return NULL;
                }
                PyErr_Clear(); /* an unhashable shape_key=: _plan_flops makes it one */
            }
        }
        if (flops == NULL) {
            PyObject *r = PyObject_CallMethodOneArg(cb, s_plan_flops, (PyObject *)self);
            if (r == NULL) {
                return NULL;
            }
            Py_DECREF(r);
        } else {
            Py_SETREF(self->flops, flops);
        }
    }
    if (read_clock(&self->t0_s) < 0) {
        return NULL;
    }
    Py_INCREF(self);
    return (PyObject *)self;
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
    /* Read, judged and recorded with the next batch of ended steps (GreenCallback._drain). */
    PyObject *cb = self->cb;
    PyObject *ended = PyObject_GetAttr(cb, s_ended);
    if (ended == NULL) {
        return NULL;
    }
    if (!PyList_Check(ended)) {
        Py_DECREF(ended);
        PyErr_SetString(PyExc_TypeError, "GreenCallback._ended must be a list");
        return NULL;
    }
    if (PyList_GET_SIZE(ended) == 0) {
        PyObject *within = PyObject_GetAttr(cb, s_judge_within_s);
        if (within == NULL) {
            Py_DECREF(ended);
            return NULL;
        }
        double w = PyFloat_AsDouble(within);
        Py_DECREF(within);
        if (w == -1.0 && PyErr_Occurred()) {
            Py_DECREF(ended);
            return NULL;
        }
        PyObject *by = PyFloat_FromDouble(t1 + w);
        if (by == NULL || PyObject_SetAttr(cb, s_judge_by, by) < 0) {
            Py_XDECREF(by);
            Py_DECREF(ended);
            return NULL;
        }
        Py_DECREF(by);
    }
    if (PyList_Append(ended, (PyObject *)self) < 0) {
        Py_DECREF(ended);
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(ended);
    Py_DECREF(ended);
    PyObject *every = PyObject_GetAttr(cb, s_judge_every);
    if (every == NULL) {
        return NULL;
    }
    Py_ssize_t e = PyLong_AsSsize_t(every);
    Py_DECREF(every);
    if (e == -1 && PyErr_Occurred()) {
        return NULL;
    }
    int drain = n >= e;
    if (!drain) {
        PyObject *by = PyObject_GetAttr(cb, s_judge_by);
        if (by == NULL) {
            return NULL;
        }
        double b = PyFloat_AsDouble(by);
        Py_DECREF(by);
        if (b == -1.0 && PyErr_Occurred()) {
            return NULL;
        }
        drain = t1 >= b;
    }
    if (drain) {
        PyObject *keep = PyObject_GetAttr(cb, s_max_unjudged);
        if (keep == NULL) {
            return NULL;
        }
        PyObject *meth = PyObject_GetAttr(cb, s_drain);
        if (meth == NULL) {
            Py_DECREF(keep);
            return NULL;
        }
        PyObject *kwnames = PyTuple_Pack(1, s_keep);
        if (kwnames == NULL) {
            Py_DECREF(meth);
            Py_DECREF(keep);
            return NULL;
        }
        PyObject *callargs[1] = {keep};
        PyObject *r = PyObject_Vectorcall(meth, callargs, 0, kwnames);
        Py_DECREF(kwnames);
        Py_DECREF(meth);
        Py_DECREF(keep);
        if (r == NULL) {
            return NULL;
        }
        Py_DECREF(r);
    }
    Py_RETURN_FALSE;
}

static PyObject *
step_loss(StepObject *self, PyObject *loss)
{
    if (g_tensor != NULL && (Py_TYPE(loss) == g_tensor || PyObject_TypeCheck(loss, g_tensor))) {
        Py_INCREF(loss);
        Py_SETREF(self->raw, loss);
        Py_RETURN_NONE;
    }
    return PyObject_CallMethodOneArg((PyObject *)self, s_loss_other, loss);
}

static PyMethodDef step_methods[] = {
    {"__enter__", (PyCFunction)step_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)(void (*)(void))step_exit, METH_FASTCALL, NULL},
    {"loss", (PyCFunction)step_loss, METH_O,
     "loss(loss)\n--\n\nReport this step's loss (a tensor or a number): see step.Step.loss."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef step_members[] = {
    {"_cb", T_OBJECT, offsetof(StepObject, cb), 0, NULL},
    {"index", T_OBJECT, offsetof(StepObject, index), 0, NULL},
    {"samples", T_OBJECT, offsetof(StepObject, samples), 0, NULL},
    {"tokens", T_OBJECT, offsetof(StepObject, tokens), 0, NULL},
    {"flops", T_OBJECT, offsetof(StepObject, flops), 0, NULL},
    {"_shape_key", T_OBJECT, offsetof(StepObject, shape_key), 0, NULL},
    {"t0_s", T_DOUBLE, offsetof(StepObject, t0_s), 0, NULL},
    {"t1_s", T_DOUBLE, offsetof(StepObject, t1_s), 0, NULL},
    {"_loss", T_OBJECT, offsetof(StepObject, loss_value), 0, NULL},
    {"_nonfinite", T_BOOL, offsetof(StepObject, nonfinite), 0, NULL},
    {"_nonfinite_cause", T_OBJECT, offsetof(StepObject, nonfinite_cause), 0, NULL},
    {"_counting", T_BOOL, offsetof(StepObject, counting), 0, NULL},
    {"_scaled", T_BOOL, offsetof(StepObject, scaled), 0, NULL},
    {"precision", T_OBJECT, offsetof(StepObject, precision), 0, NULL},
    {"_shape_guessed", T_BOOL, offsetof(StepObject, shape_guessed), 0, NULL},
    {"_forward_signature", T_OBJECT, offsetof(StepObject, forward_signature), 0, NULL},
    {"_spike_reason", T_OBJECT, offsetof(StepObject, spike_reason), 0, NULL},
    {"_pending", T_OBJECT, offsetof(StepObject, pending), 0, NULL},
    {"_raw", T_OBJECT, offsetof(StepObject, raw), 0, NULL},
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
