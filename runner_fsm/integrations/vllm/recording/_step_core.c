/* The recorder's step path in C: runner_fsm/integrations/vllm/recording/steps.py says why,
 * and holds the Python reference (`PyStepCore`) this is tested against, method by method.
 *
 * `MachineCore` holds a replica state machine's hot fields (`now`, `moves`, `lane_write`) and
 * `StepCore` the recorder's (`step_id`, `kind`, the step's journal entry, its batch, its last
 * forward, the last decisions, ...), each in one C struct: `begin_step`, `forward_hook` and
 * `end_step` read them there, not from the dicts of two Python objects, and run no Python
 * frame on a step's usual path. Every other case calls what the Python code calls (the
 * machine's `fire`, the recorder's `_end_with_records`, the journal's `render`, the
 * functions `configure` was given), in the same order, so that a step leaves the same
 * records, journal and fields either way (tests/test_step_core.py).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#ifndef STEP_CORE_SOURCE_DIGEST
#define STEP_CORE_SOURCE_DIGEST "unstamped"
#endif

#define MOVE_CACHE 8 /* (state, trigger) edges a replica takes step after step: a handful */

/* configure(...): what the Python code reads from its modules, once */
static PyObject *step_triggers;  /* recorder.STEP_TRIGGERS: kind -> Trigger */
static PyObject *finish_trigger; /* Trigger.FINISH */
static PyObject *later_type;     /* journal.Later */
static PyObject *decide_fn;      /* decisions.DECIDE */
static PyObject *changed_tail;   /* (digest, last, values) -> decisions_tail(digest, changed_since(last, values)) */
static PyObject *new_batch;      /* (requests, tokens) -> (batch identity, tokens scheduled) */
static PyObject *context_fn;     /* forwards.forward_context */
static PyObject *forwards_module; /* forwards itself: its _VLLM_CONTEXT, vLLM's module once imported */
static PyObject *no_forward;     /* recorder._NO_FORWARD */
static PyObject *no_batch;       /* (0, 0) */
static Py_ssize_t journal_batch; /* journal.BATCH */
static PyObject *s_vllm_context, *s_forward_context, *s_batch_descriptor, *s_dp_metadata, *s_runtime_mode, *s_name_,
    *s_num_tokens, *s_num_reqs, *s_uniform, *s_across_dp, *s_tolist, *s_none_mode;
static PyObject *s_idle, *s_full, *s_real, *s_dummy, *s_step, *s_kind, *s_forwards, *s_sampled, *s_fire,
    *s_lane, *s_render, *s_end_with_records, *s_values, *s_append, *s_setdefault, *s_get, *s_keys, *s_empty_bytes,
    *s_empty_tuple;

/* -- MachineCore: StepMachine's fields */

typedef struct {
    PyObject_HEAD
    PyObject *now, *moves, *lane_write;
} MachineCore;

static int
machine_traverse(MachineCore *self, visitproc visit, void *arg)
{
    Py_VISIT(self->now);
    Py_VISIT(self->moves);
    Py_VISIT(self->lane_write);
    return 0;
}

static int
machine_clear(MachineCore *self)
{
    Py_CLEAR(self->now);
    Py_CLEAR(self->moves);
    Py_CLEAR(self->lane_write);
    return 0;
}

static void
machine_dealloc(MachineCore *self)
{
    PyObject_GC_UnTrack(self);
    machine_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMemberDef machine_members[] = {
    {"now", T_OBJECT_EX, offsetof(MachineCore, now), 0, "the replica's state"},
    {"moves", T_OBJECT_EX, offsetof(MachineCore, moves), 0, "(state, trigger) -> (dst, ok record's body)"},
    {"lane_write", T_OBJECT_EX, offsetof(MachineCore, lane_write), 0, "the log's compiled lane's write, or None"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject MachineCoreType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "runner_fsm.integrations.vllm.recording._step_core.MachineCore",
    .tp_basicsize = sizeof(MachineCore),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "StepMachine's fields, read by StepCore's methods in place.",
    .tp_new = PyType_GenericNew,
    .tp_traverse = (traverseproc)machine_traverse,
    .tp_clear = (inquiry)machine_clear,
    .tp_dealloc = (destructor)machine_dealloc,
    .tp_members = machine_members,
};

/* -- StepCore: the recorder's fields and its step path */

typedef struct {
    PyObject *src, *trigger, *dst, *body;
} Move;

typedef struct {
    PyObject_HEAD
    long long step_id;
    PyObject *kind, *journal, *machine, *after_end;
    PyObject *entry, *pending, *forwards, *last_forward, *batch, *last_batch, *last_values, *gated, *decided_now;
    int move_count;
    Move move_cache[MOVE_CACHE]; /* the machine's moves, by identity: no key tuple, no hash */
} StepCore;

#define FIELDS(X) X(kind) X(journal) X(machine) X(after_end) X(entry) X(pending) X(forwards) \
    X(last_forward) X(batch) X(last_batch) X(last_values) X(gated) X(decided_now)

static void
forget_moves(StepCore *self)
{
    for (int i = 0; i < self->move_count; i++) {
        Py_CLEAR(self->move_cache[i].src);
        Py_CLEAR(self->move_cache[i].trigger);
        Py_CLEAR(self->move_cache[i].dst);
        Py_CLEAR(self->move_cache[i].body);
    }
    self->move_count = 0;
}

static int
core_traverse(StepCore *self, visitproc visit, void *arg)
{
#define VISIT(name) Py_VISIT(self->name);
    FIELDS(VISIT)
#undef VISIT
    for (int i = 0; i < self->move_count; i++) {
        Py_VISIT(self->move_cache[i].src);
        Py_VISIT(self->move_cache[i].trigger);
        Py_VISIT(self->move_cache[i].dst);
        Py_VISIT(self->move_cache[i].body);
    }
    return 0;
}

static int
core_clear(StepCore *self)
{
#define CLEAR(name) Py_CLEAR(self->name);
    FIELDS(CLEAR)
#undef CLEAR
    forget_moves(self);
    return 0;
}

static void
core_dealloc(StepCore *self)
{
    PyObject_GC_UnTrack(self);
    core_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* A field read by the step path: an AttributeError where the recorder never set it. */
static PyObject *
field(PyObject *value, const char *name)
{
    if (value == NULL)
        PyErr_Format(PyExc_AttributeError, "the recorder's %s is not set", name);
    return value;
}

#define FIELD_OR_FAIL(var, name, fail) \
    PyObject *var = field(self->name, #name); \
    if (var == NULL) \
        fail;

/* 1 and the move of `trigger` from the machine's state (`dst` and `body`: new references); 0
 * where the machine has none yet (StepMachine.fire finds it, or refuses); -1 on an error. */
static int
find_move(StepCore *self, MachineCore *machine, PyObject *trigger, PyObject **dst, PyObject **body)
{
    if (machine->now == NULL)
        return 0;
    for (int i = 0; i < self->move_count; i++) {
        Move *move = &self->move_cache[i];
        if (move->src == machine->now && move->trigger == trigger) {
            *dst = Py_NewRef(move->dst);
            *body = Py_NewRef(move->body);
            return 1;
        }
    }
    if (machine->moves == NULL || !PyDict_CheckExact(machine->moves))
        return 0;
    /* held: a state's __hash__ or __eq__ may run Python code that sets the machine's fields */
    PyObject *now = Py_NewRef(machine->now), *moves = Py_NewRef(machine->moves), *found = NULL;
    PyObject *key = PyTuple_Pack(2, now, trigger);
    int result = -1;
    if (key == NULL)
        goto done;
    found = Py_XNewRef(PyDict_GetItemWithError(moves, key));
    Py_DECREF(key);
    if (found == NULL) {
        result = PyErr_Occurred() ? -1 : 0;
        goto done;
    }
    result = 0;
    if (!PyTuple_CheckExact(found) || PyTuple_GET_SIZE(found) != 2)
        goto done;
    result = 1;
    *dst = Py_NewRef(PyTuple_GET_ITEM(found, 0));
    *body = Py_NewRef(PyTuple_GET_ITEM(found, 1));
    if (self->move_count < MOVE_CACHE) { /* a move, once made, never changes (StepMachine._first_move) */
        Move *move = &self->move_cache[self->move_count++];
        move->src = Py_NewRef(now);
        move->trigger = Py_NewRef(trigger);
        move->dst = Py_NewRef(*dst);
        move->body = Py_NewRef(*body);
    }
done:
    Py_XDECREF(found);
    Py_DECREF(moves);
    Py_DECREF(now);
    return result;
}

/* `trigger` at `step`: the compiled lane writes it where it can, else `machine.fire`
 * (`fire(trigger, step, None, tail, lane=...)` for a `finish`). 0, or -1 on an error. */
static int
move_on(StepCore *self, PyObject *trigger, PyObject *step, PyObject *tail)
{
    FIELD_OR_FAIL(machine_obj, machine, return -1)
    MachineCore *machine = (MachineCore *)Py_NewRef(machine_obj); /* held: the calls below may run Python code */
    PyObject *dst = NULL, *body = NULL;
    int found = find_move(self, machine, trigger, &dst, &body), result = -1;
    if (found < 0)
        goto done;
    PyObject *lane_write = machine->lane_write;
    if (found && lane_write != NULL && lane_write != Py_None) {
        Py_INCREF(lane_write);
        PyObject *args[3] = {step, body, tail == NULL ? s_empty_bytes : tail};
        PyObject *written = PyObject_Vectorcall(lane_write, args, 3, NULL);
        int truth = written == NULL ? -1 : PyObject_IsTrue(written);
        Py_XDECREF(written);
        Py_DECREF(lane_write);
        if (truth > 0) {
            Py_XSETREF(machine->now, Py_NewRef(dst));
            result = 0;
            goto done;
        }
        if (truth < 0)
            goto done;
    }
    PyObject *kwargs = Py_BuildValue("{OO}", s_lane, found ? Py_False : Py_True);
    PyObject *fire = kwargs != NULL ? PyObject_GetAttr(machine_obj, s_fire) : NULL, *args = NULL;
    if (fire != NULL)
        args = tail == NULL ? PyTuple_Pack(2, trigger, step) : PyTuple_Pack(4, trigger, step, Py_None, tail);
    PyObject *fired = args != NULL ? PyObject_Call(fire, args, kwargs) : NULL;
    Py_XDECREF(fire);
    Py_XDECREF(args);
    Py_XDECREF(kwargs);
    if (fired != NULL) {
        Py_DECREF(fired);
        result = 0;
    }
done:
    Py_XDECREF(dst);
    Py_XDECREF(body);
    Py_DECREF(machine);
    return result;
}

/* Positional and keyword arguments into `out` (by `names`), defaults left as they are. */
static int
parse(const char *what, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames, const char *const *names,
      Py_ssize_t positional, Py_ssize_t count, PyObject **out)
{
    if (nargs > positional) {
        PyErr_Format(PyExc_TypeError, "%s takes at most %zd positional arguments", what, positional);
        return -1;
    }
    for (Py_ssize_t i = 0; i < nargs; i++)
        out[i] = args[i];
    Py_ssize_t nkw = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);
    for (Py_ssize_t k = 0; k < nkw; k++) {
        PyObject *name = PyTuple_GET_ITEM(kwnames, k);
        Py_ssize_t i = 0;
        while (i < count && PyUnicode_CompareWithASCIIString(name, names[i]) != 0)
            i++;
        if (i == count || i < nargs) {
            PyErr_Format(PyExc_TypeError, "%s got an unexpected or repeated argument %R", what, name);
            return -1;
        }
        out[i] = args[nargs + k];
    }
    return 0;
}

/* `value == text` as Python reads it: 1, 0, or -1 on an error (a str subclass's or any other
 * object's __eq__ is its own) */
static int
is_str(PyObject *value, PyObject *interned)
{
    if (value == interned)
        return 1;
    if (PyUnicode_CheckExact(value))
        return PyUnicode_Compare(value, interned) == 0;
    return PyObject_RichCompareBool(value, interned, Py_EQ);
}

/* `container.append(item)`: a list's in place, anything else's method */
static int
append(PyObject *container, PyObject *item)
{
    if (PyList_CheckExact(container))
        return PyList_Append(container, item);
    PyObject *done = PyObject_CallMethodOneArg(container, s_append, item);
    Py_XDECREF(done);
    return done == NULL ? -1 : 0;
}

#define CONFIGURED(fail) \
    if (step_triggers == NULL) { \
        PyErr_SetString(PyExc_RuntimeError, "the compiled step path is not configured (steps.load)"); \
        fail; \
    }

/* The batch of a real step from `scheduled` ({request id: tokens}), computed again only where
 * its requests or tokens changed. */
static int
take_batch(StepCore *self, PyObject *scheduled)
{
    /* `order, counts, batch = self._last_batch`: held, as a request id's __eq__ may run Python
     * code that sets the field */
    FIELD_OR_FAIL(last_field, last_batch, return -1)
    PyObject *last = PySequence_Tuple(last_field), *keys = NULL, *tokens = NULL, *batch = NULL;
    if (last == NULL)
        return -1;
    if (PyTuple_GET_SIZE(last) != 3) {
        PyErr_Format(PyExc_ValueError, "the recorder's _last_batch has %zd values, not (requests, tokens, batch)",
                     PyTuple_GET_SIZE(last));
        goto fail;
    }
    if (PyDict_CheckExact(scheduled)) { /* in the batch's order: the identity depends on it */
        keys = PyDict_Keys(scheduled);
        tokens = PyDict_Values(scheduled);
    } else {
        keys = PySequence_List(scheduled);
        PyObject *values = PyObject_CallMethodNoArgs(scheduled, s_values);
        tokens = values != NULL ? PySequence_List(values) : NULL;
        Py_XDECREF(values);
    }
    if (keys == NULL || tokens == NULL)
        goto fail;
    int same = PyObject_RichCompareBool(keys, PyTuple_GET_ITEM(last, 0), Py_EQ);
    if (same > 0)
        same = PyObject_RichCompareBool(tokens, PyTuple_GET_ITEM(last, 1), Py_EQ);
    if (same < 0)
        goto fail;
    if (same) {
        batch = Py_NewRef(PyTuple_GET_ITEM(last, 2));
    } else {
        batch = PyObject_CallFunctionObjArgs(new_batch, keys, tokens, NULL);
        PyObject *kept = batch != NULL ? PyTuple_Pack(3, keys, tokens, batch) : NULL;
        if (kept == NULL)
            goto fail;
        Py_XSETREF(self->last_batch, kept);
    }
    Py_XSETREF(self->batch, batch);
    Py_DECREF(keys);
    Py_DECREF(tokens);
    Py_DECREF(last);
    return 0;
fail:
    Py_XDECREF(batch);
    Py_XDECREF(keys);
    Py_XDECREF(tokens);
    Py_DECREF(last);
    return -1;
}

static PyObject *
begin_step(StepCore *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    CONFIGURED(return NULL)
    static const char *const names[] = {"kind", "decision", "scheduled", "entry"};
    PyObject *given[4] = {NULL, Py_None, Py_None, Py_None};
    if (parse("begin_step", args, nargs, kwnames, names, 3, 4, given) < 0)
        return NULL;
    PyObject *kind = given[0], *decision = given[1], *scheduled = given[2], *entry = given[3];
    if (kind == NULL) {
        PyErr_SetString(PyExc_TypeError, "begin_step() needs the step's kind");
        return NULL;
    }
    /* the previous step's journal entry: complete now (`Journal.write`); both held, as a
     * journal that is not a list runs Python code */
    if (self->entry != NULL && self->entry != Py_None && self->pending != NULL && self->pending != Py_None) {
        PyObject *previous = Py_NewRef(self->entry), *pending = Py_NewRef(self->pending);
        int appended = append(pending, previous);
        Py_DECREF(previous);
        if (appended == 0) /* handed over: a refused move must not hand it over twice */
            Py_XSETREF(self->entry, Py_NewRef(Py_None));
        Py_ssize_t waiting = appended < 0 ? -1 : PyObject_Length(pending);
        Py_DECREF(pending);
        if (waiting < 0)
            return NULL;
        if (waiting >= journal_batch) {
            FIELD_OR_FAIL(journal, journal, return NULL)
            PyObject *rendered = PyObject_CallMethodNoArgs(journal, s_render);
            if (rendered == NULL)
                return NULL;
            Py_DECREF(rendered);
        }
    }
    PyObject *trigger = Py_XNewRef(PyDict_GetItemWithError(step_triggers, kind)), *step = NULL;
    if (trigger == NULL) {
        if (!PyErr_Occurred()) { /* as a dict says it: the key, even a tuple, as one argument */
            PyObject *key = PyTuple_Pack(1, kind);
            if (key != NULL) {
                PyErr_SetObject(PyExc_KeyError, key);
                Py_DECREF(key);
            }
        }
        return NULL;
    }
    step = PyLong_FromLongLong(self->step_id);
    if (step == NULL || move_on(self, trigger, step, NULL) < 0)
        goto fail; /* a refusal raises StepRefused: nothing changed */
    Py_CLEAR(trigger);
    Py_XSETREF(self->kind, Py_NewRef(kind));
    Py_XSETREF(self->gated, Py_NewRef(Py_None));
    Py_XSETREF(self->decided_now, Py_NewRef(Py_None));
    Py_XSETREF(self->last_forward, Py_NewRef(no_forward));
    int real = PyObject_IsTrue(scheduled);
    if (real < 0)
        goto fail;
    if (real) {
        if (take_batch(self, scheduled) < 0)
            goto fail;
    } else {
        Py_XSETREF(self->batch, Py_NewRef(no_batch));
    }
    if (entry == Py_None) {
        entry = PyDict_New();
        if (entry == NULL || PyDict_SetItem(entry, s_step, step) < 0 || PyDict_SetItem(entry, s_kind, kind) < 0)
            goto fail_entry;
        int merge = PyObject_IsTrue(decision); /* `**(decision or {})` */
        if (merge < 0)
            goto fail_entry;
        if (merge && !PyDict_Check(decision) && !PyObject_HasAttr(decision, s_keys)) {
            PyErr_Format(PyExc_TypeError, "'%.200s' object is not a mapping", Py_TYPE(decision)->tp_name);
            goto fail_entry;
        }
        if (merge && PyDict_Update(entry, decision) < 0)
            goto fail_entry;
    } else {
        Py_INCREF(entry);
    }
    Py_XSETREF(self->entry, entry);
    return step;
fail_entry:
    Py_XDECREF(entry);
fail:
    Py_XDECREF(trigger);
    Py_XDECREF(step);
    return NULL;
}

/* `forwards.forward_context()`, read in place: (graph mode name, batch descriptor as (tokens,
 * reqs, uniform), DP token counts), from vLLM's module `forwards` found (it calls the Python
 * function the first time, which imports it), as that function reads it */
static PyObject *
read_context(void)
{
    PyObject *vllm = PyObject_GetAttr(forwards_module, s_vllm_context);
    if (vllm == NULL)
        return NULL;
    if (vllm == Py_None) {
        Py_DECREF(vllm);
        return PyObject_CallNoArgs(context_fn);
    }
    PyObject *ctx = PyObject_GetAttr(vllm, s_forward_context);
    Py_DECREF(vllm);
    if (ctx == NULL)
        return NULL;
    if (ctx == Py_None) {
        Py_DECREF(ctx);
        return PyTuple_Pack(3, s_none_mode, Py_None, Py_None);
    }
    PyObject *desc = NULL, *dp = NULL, *runtime = NULL, *mode = NULL, *shape = NULL, *counts = NULL, *out = NULL;
    if ((desc = PyObject_GetAttr(ctx, s_batch_descriptor)) == NULL || (dp = PyObject_GetAttr(ctx, s_dp_metadata)) == NULL ||
        (runtime = PyObject_GetAttr(ctx, s_runtime_mode)) == NULL || (mode = PyObject_GetAttr(runtime, s_name_)) == NULL)
        goto done;
    if (desc == Py_None) {
        shape = Py_NewRef(Py_None);
    } else {
        PyObject *tokens = PyObject_GetAttr(desc, s_num_tokens), *reqs = tokens ? PyObject_GetAttr(desc, s_num_reqs) : NULL,
                 *uniform = reqs ? PyObject_GetAttr(desc, s_uniform) : NULL;
        shape = uniform ? PyTuple_Pack(3, tokens, reqs, uniform) : NULL;
        Py_XDECREF(tokens);
        Py_XDECREF(reqs);
        Py_XDECREF(uniform);
        if (shape == NULL)
            goto done;
    }
    if (dp == Py_None) {
        counts = Py_NewRef(Py_None);
    } else {
        PyObject *across = PyObject_GetAttr(dp, s_across_dp);
        counts = across ? PyObject_CallMethodNoArgs(across, s_tolist) : NULL;
        Py_XDECREF(across);
        if (counts == NULL)
            goto done;
    }
    out = PyTuple_Pack(3, mode, shape, counts);
done:
    Py_DECREF(ctx);
    Py_XDECREF(desc);
    Py_XDECREF(dp);
    Py_XDECREF(runtime);
    Py_XDECREF(mode);
    Py_XDECREF(shape);
    Py_XDECREF(counts);
    return out;
}

static PyObject *
forward_hook(StepCore *self, PyObject *const *Py_UNUSED(args), Py_ssize_t nargs)
{
    CONFIGURED(return NULL)
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "forward_hook(module, args, kwargs)");
        return NULL;
    }
    PyObject *context = read_context();
    if (context == NULL)
        return NULL;
    if (!PyTuple_CheckExact(context) || PyTuple_GET_SIZE(context) != 3) {
        Py_DECREF(context);
        PyErr_SetString(PyExc_TypeError, "forward_context() is not (mode, descriptor, DP counts)");
        return NULL;
    }
    /* each field held while it is used: a comparison, an append or a dict lookup may run
     * Python code that sets them */
    PyObject *mode = PyTuple_GET_ITEM(context, 0), *desc = PyTuple_GET_ITEM(context, 1),
             *dp_counts = PyTuple_GET_ITEM(context, 2), *kind = Py_XNewRef(self->kind), *entry = NULL, *list = NULL,
             *result = NULL;
    int full = is_str(mode, s_full), dummy = 0;
    if (full < 0)
        goto done;
    if ((kind == NULL || kind == Py_None) && !full) { /* outside steps, only a graph capture counts */
        result = Py_NewRef(Py_None);
        goto done;
    }
    if (kind != NULL && (dummy = is_str(kind, s_idle)) < 0)
        goto done;
    PyObject *last = PyTuple_Pack(2, mode, desc);
    if (last == NULL)
        goto done;
    Py_XSETREF(self->last_forward, last);
    if (full) { /* a graph record (eager at `transitions`: none) */
        FIELD_OR_FAIL(forwards_field, forwards, goto done)
        PyObject *forwards = Py_NewRef(forwards_field);
        PyObject *record = Py_BuildValue("(OOOOOO)", Py_None, s_empty_tuple, dummy ? Py_True : Py_False, mode,
                                         desc, Py_False);
        int appended = record != NULL ? append(forwards, record) : -1;
        Py_XDECREF(record);
        Py_DECREF(forwards);
        if (appended < 0)
            goto done;
    }
    entry = Py_XNewRef(self->entry);
    if (entry != NULL && entry != Py_None) { /* `entry.setdefault("forwards", []).append(row)` */
        if (PyDict_CheckExact(entry)) {
            list = Py_XNewRef(PyDict_GetItemWithError(entry, s_forwards));
            if (list == NULL) {
                if (PyErr_Occurred() || (list = PyList_New(0)) == NULL || PyDict_SetItem(entry, s_forwards, list) < 0)
                    goto done;
            }
        } else {
            PyObject *fresh = PyList_New(0);
            list = fresh != NULL ? PyObject_CallMethodObjArgs(entry, s_setdefault, s_forwards, fresh, NULL) : NULL;
            Py_XDECREF(fresh);
            if (list == NULL)
                goto done;
        }
        PyObject *row = PyList_New(4);
        if (row == NULL)
            goto done;
        PyList_SET_ITEM(row, 0, Py_NewRef(dummy ? s_dummy : s_real));
        PyList_SET_ITEM(row, 1, Py_NewRef(mode));
        PyList_SET_ITEM(row, 2, Py_NewRef(desc));
        PyList_SET_ITEM(row, 3, Py_NewRef(dp_counts));
        int appended = append(list, row);
        Py_DECREF(row);
        if (appended < 0)
            goto done;
    }
    result = Py_NewRef(Py_None);
done:
    Py_XDECREF(list);
    Py_XDECREF(entry);
    Py_XDECREF(kind);
    Py_DECREF(context);
    return result;
}

/* The step's decisions (`values`, as the Python reference builds them); NULL on an error. */
static PyObject *
step_values(StepCore *self, PyObject *drafted, PyObject *draft_steps)
{
    /* `mode, desc = self._last_forward`, then `identity, scheduled = self._batch`, in this
     * order and held: a descriptor's __bool__ or __getitem__ may run Python code that sets them */
    FIELD_OR_FAIL(last_field, last_forward, return NULL)
    PyObject *last = PySequence_Tuple(last_field), *batch = NULL, *kind = NULL, *size = NULL, *graph = NULL,
             *draft = NULL, *real = NULL, *values = NULL;
    if (last == NULL)
        return NULL;
    if (PyTuple_GET_SIZE(last) != 2) {
        PyErr_SetString(PyExc_ValueError, "the recorder's _last_forward is not (graph mode, descriptor)");
        goto done;
    }
    PyObject *mode = PyTuple_GET_ITEM(last, 0), *desc = PyTuple_GET_ITEM(last, 1);
    int sized = PyObject_IsTrue(desc), idle = 0, full = 0, drafts = 0;
    if (sized < 0)
        goto done;
    if (sized) { /* `desc[0]`: an item, whatever the descriptor is */
        PyObject *zero = PyLong_FromLong(0);
        size = zero != NULL ? PyObject_GetItem(desc, zero) : NULL;
        Py_XDECREF(zero);
    } else {
        size = PyLong_FromLong(0);
    }
    if (size == NULL)
        goto done;
    FIELD_OR_FAIL(batch_field, batch, goto done)
    if ((batch = PySequence_Tuple(batch_field)) == NULL)
        goto done;
    if (PyTuple_GET_SIZE(batch) != 2) {
        PyErr_SetString(PyExc_ValueError, "the recorder's _batch is not (identity, tokens scheduled)");
        goto done;
    }
    kind = Py_XNewRef(self->kind);
    if ( (idle = kind != NULL && kind != Py_None ? is_str(kind, s_idle) : 0) < 0 ||
        (full = is_str(mode, s_full)) < 0 || (drafts = PyObject_IsTrue(drafted)) < 0)
        goto done;
    graph = full ? Py_NewRef(size) : PyLong_FromLong(0);
    draft = drafts ? Py_NewRef(draft_steps) : PyLong_FromLong(0);
    real = PyLong_FromLong(idle ? 0 : 1);
    if (graph != NULL && draft != NULL && real != NULL)
        values = PyTuple_Pack(6, real, PyTuple_GET_ITEM(batch, 0), PyTuple_GET_ITEM(batch, 1), size, graph, draft);
done:
    Py_XDECREF(last);
    Py_XDECREF(batch);
    Py_XDECREF(kind);
    Py_XDECREF(size);
    Py_XDECREF(graph);
    Py_XDECREF(draft);
    Py_XDECREF(real);
    return values;
}

static PyObject *
end_step(StepCore *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    CONFIGURED(return NULL)
    static const char *const names[] = {"drafted", "draft_steps", "sampled"};
    PyObject *given[3] = {Py_False, NULL, Py_None};
    PyObject *zero = PyLong_FromLong(0), *entry = NULL, *gated = NULL, *values = NULL, *decided = NULL, *tail = NULL,
             *step = NULL, *sampled_ref = NULL, *drafted_ref = NULL, *steps_ref = NULL, *last = NULL;
    if (zero == NULL)
        return NULL;
    given[1] = zero;
    if (parse("end_step", args, nargs, kwnames, names, 3, 3, given) < 0)
        goto fail;
    PyObject *sampled = given[2];
    entry = Py_XNewRef(self->entry); /* held: setting or getting an item may run Python code */
    int has_entry = entry != NULL && entry != Py_None;
    if (sampled != Py_None) {
        if (has_entry && PyObject_SetItem(entry, s_sampled, sampled) < 0)
            goto fail;
        sampled_ref = Py_NewRef(sampled);
    } else if (has_entry) { /* `note(sampled=...)`; not known yet where `note_later` gave them */
        sampled_ref = PyDict_CheckExact(entry) ? Py_XNewRef(PyDict_GetItemWithError(entry, s_sampled))
                                               : PyObject_CallMethodOneArg(entry, s_get, s_sampled);
        if (sampled_ref == NULL && PyErr_Occurred())
            goto fail;
        if (sampled_ref == NULL || Py_IS_TYPE(sampled_ref, (PyTypeObject *)later_type))
            Py_XSETREF(sampled_ref, Py_NewRef(Py_None));
    } else {
        sampled_ref = Py_NewRef(Py_None);
    }
    drafted_ref = Py_NewRef(given[0]);
    steps_ref = Py_NewRef(given[1]);
    gated = Py_XNewRef(self->gated);
    if (gated != NULL && gated != Py_None) { /* the drafter's gate decided this step (`gate`) */
        Py_XSETREF(self->gated, Py_NewRef(Py_None)); /* first: the comparison may raise, or run Python code */
        PyObject *more = PyObject_RichCompare(gated, zero, Py_GT); /* `gated > 0`, as it is */
        if (more == NULL)
            goto fail;
        Py_SETREF(drafted_ref, more);
        Py_SETREF(steps_ref, Py_NewRef(gated));
    }
    if ((values = step_values(self, drafted_ref, steps_ref)) == NULL)
        goto fail;
    last = Py_NewRef(self->last_values != NULL ? self->last_values : Py_None);
    PyObject *decide_args[3] = {values, sampled_ref, last};
    PyObject *returned = PyObject_Vectorcall(decide_fn, decide_args, 3, NULL);
    decided = returned != NULL ? PySequence_Tuple(returned) : NULL;
    Py_XDECREF(returned);
    if (decided == NULL)
        goto fail;
    if (PyTuple_GET_SIZE(decided) != 3) {
        PyErr_SetString(PyExc_ValueError, "decide() is not (tokens, digest, tail)");
        goto fail;
    }
    PyObject *now = PyTuple_New(7);
    if (now == NULL)
        goto fail;
    for (Py_ssize_t i = 0; i < 6; i++)
        PyTuple_SET_ITEM(now, i, Py_NewRef(PyTuple_GET_ITEM(values, i)));
    PyTuple_SET_ITEM(now, 6, Py_NewRef(PyTuple_GET_ITEM(decided, 0)));
    Py_XSETREF(self->decided_now, now);
    tail = Py_NewRef(PyTuple_GET_ITEM(decided, 2));
    if (tail == Py_None) { /* a decision changed (or the first step): the changes rendered too */
        Py_SETREF(last, Py_NewRef(self->last_values != NULL ? self->last_values : Py_None));
        Py_SETREF(tail, PyObject_CallFunctionObjArgs(changed_tail, PyTuple_GET_ITEM(decided, 1), last, values, NULL));
        if (tail == NULL)
            goto fail;
        Py_XSETREF(self->last_values, Py_NewRef(values));
    }
    long long step_id = self->step_id;
    if ((step = PyLong_FromLongLong(step_id)) == NULL)
        goto fail;
    FIELD_OR_FAIL(forwards_field, forwards, goto fail)
    PyObject *forwards = Py_NewRef(forwards_field);
    int records = PyObject_IsTrue(forwards);
    Py_DECREF(forwards);
    if (records == 0 && (records = PyObject_IsTrue(drafted_ref)) < 0) /* `self._forwards or drafted` */
        goto fail;
    if (records < 0)
        goto fail;
    if (records) {
        PyObject *ended = PyObject_CallMethodObjArgs((PyObject *)self, s_end_with_records, step, drafted_ref, tail,
                                                     NULL);
        if (ended == NULL)
            goto fail;
        Py_DECREF(ended);
    } else if (move_on(self, finish_trigger, step, tail) < 0) { /* most steps: `finish` alone */
        goto fail;
    }
    Py_XSETREF(self->kind, Py_NewRef(Py_None));
    if (step_id == LLONG_MAX) {
        PyErr_SetString(PyExc_OverflowError, "the recorder's step_id is at its largest");
        goto fail;
    }
    self->step_id = step_id + 1; /* `step + 1`: whatever `_end_with_records` set it to */
    Py_DECREF(step);
    Py_DECREF(tail);
    Py_DECREF(decided);
    Py_DECREF(values);
    Py_DECREF(sampled_ref);
    Py_DECREF(drafted_ref);
    Py_DECREF(steps_ref);
    Py_DECREF(last);
    Py_XDECREF(gated);
    Py_XDECREF(entry);
    Py_DECREF(zero);
    PyObject *after = Py_XNewRef(self->after_end);
    if (after != NULL && after != Py_None) {
        PyObject *done = PyObject_CallNoArgs(after);
        Py_DECREF(after);
        if (done == NULL)
            return NULL;
        Py_DECREF(done);
    } else {
        Py_XDECREF(after);
    }
    Py_RETURN_NONE;
fail:
    Py_XDECREF(step);
    Py_XDECREF(tail);
    Py_XDECREF(decided);
    Py_XDECREF(values);
    Py_XDECREF(sampled_ref);
    Py_XDECREF(drafted_ref);
    Py_XDECREF(steps_ref);
    Py_XDECREF(last);
    Py_XDECREF(gated);
    Py_XDECREF(entry);
    Py_DECREF(zero);
    return NULL;
}

static PyObject *
get_machine(StepCore *self, void *Py_UNUSED(closure))
{
    return Py_XNewRef(field(self->machine, "machine"));
}

static int
set_machine(StepCore *self, PyObject *value, void *Py_UNUSED(closure))
{
    if (value == NULL || !PyObject_TypeCheck(value, &MachineCoreType)) {
        PyErr_SetString(PyExc_TypeError, "the recorder's machine is a MachineCore (StepMachine)");
        return -1;
    }
    forget_moves(self); /* another machine: other moves */
    Py_XSETREF(self->machine, Py_NewRef(value));
    return 0;
}

#define MEMBER(name, attr, doc) {name, T_OBJECT_EX, offsetof(StepCore, attr), 0, doc},
static PyMemberDef core_members[] = {
    {"step_id", T_LONGLONG, offsetof(StepCore, step_id), 0, "the step being run, or the next one between steps"},
    MEMBER("kind", kind, "prefill | decode | idle while a step runs, else None")
    MEMBER("journal", journal, "the replica's journal, or None")
    MEMBER("after_end", after_end, "called once a step's records are written, or None")
    MEMBER("_entry", entry, "this step's journal entry")
    MEMBER("_pending", pending, "the journal's entries not rendered yet, or None")
    MEMBER("_forwards", forwards, "this step's forwards that leave records")
    MEMBER("_last_forward", last_forward, "this step's last target forward: (graph mode, batch descriptor)")
    MEMBER("_batch", batch, "this step's batch: (its identity, the tokens scheduled)")
    MEMBER("_last_batch", last_batch, "the last real batch: (requests, tokens, its _batch)")
    MEMBER("_last_values", last_values, "the decisions the last finish carried")
    MEMBER("_gated", gated, "drafter steps this step's gate let run, or None")
    MEMBER("_decided_now", decided_now, "the last ended step's decisions, as values")
    {NULL, 0, 0, 0, NULL},
};

static PyGetSetDef core_getset[] = {
    {"machine", (getter)get_machine, (setter)set_machine, "the replica's StepMachine", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef core_methods[] = {
    {"begin_step", (PyCFunction)(void (*)(void))begin_step, METH_FASTCALL | METH_KEYWORDS,
     "begin_step(kind, decision=None, scheduled=None, *, entry=None) -> step id (steps.PyStepCore)"},
    {"forward_hook", (PyCFunction)(void (*)(void))forward_hook, METH_FASTCALL,
     "forward_hook(module, args, kwargs): a forward pre-hook (steps.PyStepCore)"},
    {"end_step", (PyCFunction)(void (*)(void))end_step, METH_FASTCALL | METH_KEYWORDS,
     "end_step(drafted=False, draft_steps=0, sampled=None) (steps.PyStepCore)"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject StepCoreType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "runner_fsm.integrations.vllm.recording._step_core.StepCore",
    .tp_basicsize = sizeof(StepCore),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The recorder's fields and its step path (steps.PyStepCore is the reference).",
    .tp_new = PyType_GenericNew,
    .tp_traverse = (traverseproc)core_traverse,
    .tp_clear = (inquiry)core_clear,
    .tp_dealloc = (destructor)core_dealloc,
    .tp_members = core_members,
    .tp_getset = core_getset,
    .tp_methods = core_methods,
};

/* configure(step_triggers, finish, later, decide, changed_tail, new_batch, forward_context,
 * no_forward, journal_batch, forwards): once, by steps.py, before any StepCore steps */
static PyObject *
configure(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 10 || !PyDict_CheckExact(args[0]) || !PyType_Check(args[2]) || !PyLong_Check(args[8]) ||
        !PyModule_Check(args[9])) {
        PyErr_SetString(PyExc_TypeError, "configure(step_triggers: dict, finish, later: type, decide, changed_tail,"
                                         " new_batch, forward_context, no_forward, journal_batch: int, forwards: module)");
        return NULL;
    }
    Py_ssize_t batch = PyLong_AsSsize_t(args[8]);
    if (batch < 0)
        return PyErr_Occurred() ? NULL : (PyErr_SetString(PyExc_ValueError, "journal_batch < 0"), NULL);
    PyObject **slots[] = {&step_triggers, &finish_trigger, &later_type, &decide_fn, &changed_tail, &new_batch,
                          &context_fn, &no_forward, NULL, &forwards_module};
    for (int i = 0; i < 10; i++)
        if (slots[i] != NULL) /* 8: journal_batch, below */
            Py_XSETREF(*slots[i], Py_NewRef(args[i]));
    journal_batch = batch;
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"configure", (PyCFunction)(void (*)(void))configure, METH_FASTCALL,
     "configure(step_triggers, finish, later, decide, changed_tail, new_batch, forward_context, no_forward,"
     " journal_batch, forwards): what the step path calls, once."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_step_core", "The recorder's step path in C.", -1, module_methods,
    NULL, NULL, NULL, NULL,
};

static int
intern_all(void)
{
    struct {
        PyObject **slot;
        const char *text;
    } strings[] = {{&s_idle, "idle"},     {&s_full, "FULL"},         {&s_real, "real"},     {&s_dummy, "dummy"},
                   {&s_step, "step"},     {&s_kind, "kind"},         {&s_forwards, "forwards"},
                   {&s_sampled, "sampled"}, {&s_fire, "fire"},       {&s_lane, "lane"},     {&s_render, "render"},
                   {&s_end_with_records, "_end_with_records"},       {&s_values, "values"},
                   {&s_append, "append"}, {&s_setdefault, "setdefault"}, {&s_get, "get"}, {&s_keys, "keys"},
                   {&s_vllm_context, "_VLLM_CONTEXT"}, {&s_forward_context, "_forward_context"},
                   {&s_batch_descriptor, "batch_descriptor"}, {&s_dp_metadata, "dp_metadata"},
                   {&s_runtime_mode, "cudagraph_runtime_mode"}, {&s_name_, "_name_"}, {&s_num_tokens, "num_tokens"},
                   {&s_num_reqs, "num_reqs"}, {&s_uniform, "uniform"}, {&s_across_dp, "num_tokens_across_dp_cpu"},
                   {&s_tolist, "tolist"}, {&s_none_mode, "NONE"}};
    for (size_t i = 0; i < sizeof strings / sizeof strings[0]; i++)
        if ((*strings[i].slot = PyUnicode_InternFromString(strings[i].text)) == NULL)
            return -1;
    s_empty_bytes = PyBytes_FromStringAndSize("", 0);
    s_empty_tuple = PyTuple_New(0);
    no_batch = Py_BuildValue("(ii)", 0, 0);
    return s_empty_bytes == NULL || s_empty_tuple == NULL || no_batch == NULL ? -1 : 0;
}

PyMODINIT_FUNC
PyInit__step_core(void)
{
    if (PyType_Ready(&MachineCoreType) < 0 || PyType_Ready(&StepCoreType) < 0 || intern_all() < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddStringConstant(m, "SOURCE_DIGEST", STEP_CORE_SOURCE_DIGEST) < 0 ||
        PyModule_AddObjectRef(m, "MachineCore", (PyObject *)&MachineCoreType) < 0 ||
        PyModule_AddObjectRef(m, "StepCore", (PyObject *)&StepCoreType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
