/* The step lane's state, and its write in C: runner_fsm/audit/step_lane.py says why.
 *
 * `LaneState` holds what a transition's line needs and changes, in one place: the log's next
 * seq (`seq`), the compact renderer's last step, its time and its last transition's `dst`
 * (`step`, `step_t`, `state`), and the mapped file's unwritten bytes (`room`), with the map
 * itself (`attach`, `detach`). `AuditLog`, `CompactRenderer` and `MappedFile` keep these fields
 * here, not in their own attributes, so that `write` touches one object, not the five whose
 * cold cache lines cost about as much as the Python code did.
 *
 * `write(step_id, body, tail=b"")` writes one transition as `AuditLog.step_transition` does
 * (the same bytes: tests/test_step_lane_native.py) and returns True; or returns False, having
 * changed nothing, where the Python method must write it: the lane closed (`open` false: a
 * plain log, a segment switch due, the log closed), a signal handler's record waiting, the
 * log's lock taken, a line that may not fit the map, a step id that is no int of 64 bits.
 * It takes the log's lock without blocking and holds it while it allocates nothing and calls
 * no Python code: no other thread and no signal handler can run meanwhile, so `_holder` (the
 * log's answer to a handler in the writing thread) is never needed here.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <limits.h>
#include <stddef.h>
#include <string.h>
#include <time.h>

#ifndef STEP_LANE_SOURCE_DIGEST
#define STEP_LANE_SOURCE_DIGEST "unstamped"
#endif

#define EDGE_CACHE 16 /* transition bodies a vLLM worker writes: a handful */
#define HEAD_MAX 80   /* {"s":<20>,"q":<20>,"t":<17>, is 73 at the most (step_t >= 0, below) */

static PyObject *edges;    /* compact._EDGES: body -> (src, dst, short body or None) */
static PyObject *new_step; /* compact._NEW_STEP */

typedef struct {
    PyObject *body, *src, *dst, *shortened; /* shortened: NULL where the edge has none */
} Edge;

typedef struct {
    PyObject_HEAD
    long long seq;
    PyObject *step;  /* the step of the last record written, or compact._NEW_STEP */
    long long step_t;
    PyObject *state; /* the last transition's dst, or None */
    long long room;
    int open;
    PyObject *acquire, *release, *deferred; /* the log's lock's methods, its handler queue */
    Py_buffer view;
    int attached;
    int edge_count;
    Edge edge_cache[EDGE_CACHE];
    Edge spare; /* borrowed from compact._EDGES, once the cache is full */
} LaneState;

static int
lane_init(LaneState *self, PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"lock", "deferred", NULL};
    PyObject *lock = Py_None, *deferred = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|OO:LaneState", names, &lock, &deferred))
        return -1;
    Py_XSETREF(self->step, Py_NewRef(new_step != NULL ? new_step : Py_None));
    Py_XSETREF(self->state, Py_NewRef(Py_None));
    if (lock != Py_None) {
        PyObject *acquire = PyObject_GetAttrString(lock, "acquire");
        PyObject *release = acquire ? PyObject_GetAttrString(lock, "release") : NULL;
        if (release == NULL) {
            Py_XDECREF(acquire);
            return -1;
        }
        Py_XSETREF(self->acquire, acquire);
        Py_XSETREF(self->release, release);
    }
    if (deferred != Py_None)
        Py_XSETREF(self->deferred, Py_NewRef(deferred));
    return 0;
}

static void
lane_detach_view(LaneState *self)
{
    if (self->attached) {
        self->attached = 0;
        PyBuffer_Release(&self->view);
    }
}

static void
lane_dealloc(LaneState *self)
{
    lane_detach_view(self);
    for (int i = 0; i < self->edge_count; i++) {
        Edge *e = &self->edge_cache[i];
        Py_DECREF(e->body);
        Py_DECREF(e->src);
        Py_DECREF(e->dst);
        Py_XDECREF(e->shortened);
    }
    Py_XDECREF(self->step);
    Py_XDECREF(self->state);
    Py_XDECREF(self->acquire);
    Py_XDECREF(self->release);
    Py_XDECREF(self->deferred);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* attach(mapping): the map `write` copies into, at its end less `room`; held (an exported
 * buffer: the map cannot be resized or closed) until `detach()`. */
static PyObject *
lane_attach(LaneState *self, PyObject *mapping)
{
    lane_detach_view(self);
    if (PyObject_GetBuffer(mapping, &self->view, PyBUF_WRITABLE | PyBUF_SIMPLE) < 0)
        return NULL;
    self->attached = 1;
    Py_RETURN_NONE;
}

static PyObject *
lane_detach(LaneState *self, PyObject *Py_UNUSED(ignored))
{
    lane_detach_view(self);
    Py_RETURN_NONE;
}

/* The edge of `body` (compact._EDGES), or NULL where it has none; cached by identity: the
 * worker writes the same few body objects every step. -1 on error. */
static int
find_edge(LaneState *self, PyObject *body, Edge **out)
{
    *out = NULL;
    for (int i = 0; i < self->edge_count; i++) {
        if (self->edge_cache[i].body == body) {
            *out = &self->edge_cache[i];
            return 0;
        }
    }
    if (edges == NULL)
        return 0;
    PyObject *edge = PyDict_GetItemWithError(edges, body); /* borrowed; the bytes hash is cached */
    if (edge == NULL)
        return PyErr_Occurred() ? -1 : 0;
    if (!PyTuple_CheckExact(edge) || PyTuple_GET_SIZE(edge) != 3 ||
        (PyTuple_GET_ITEM(edge, 2) != Py_None && !PyBytes_CheckExact(PyTuple_GET_ITEM(edge, 2)))) {
        PyErr_SetString(PyExc_TypeError, "compact._EDGES holds (src, dst, short body or None)");
        return -1;
    }
    if (self->edge_count == EDGE_CACHE) { /* not kept: the dict's tuple, each time (it holds them) */
        Edge *e = &self->spare;
        e->body = body;
        e->src = PyTuple_GET_ITEM(edge, 0);
        e->dst = PyTuple_GET_ITEM(edge, 1);
        e->shortened = PyTuple_GET_ITEM(edge, 2) == Py_None ? NULL : PyTuple_GET_ITEM(edge, 2);
        *out = e;
        return 0;
    }
    Edge *e = &self->edge_cache[self->edge_count++];
    e->body = Py_NewRef(body);
    e->src = Py_NewRef(PyTuple_GET_ITEM(edge, 0));
    e->dst = Py_NewRef(PyTuple_GET_ITEM(edge, 1));
    e->shortened = PyTuple_GET_ITEM(edge, 2) == Py_None ? NULL : Py_NewRef(PyTuple_GET_ITEM(edge, 2));
    *out = e;
    return 0;
}

/* Python's floor division by 1000, for a negative difference too. */
static long long
floor_us(long long ns)
{
    long long q = ns / 1000;
    return (ns % 1000 < 0) ? q - 1 : q;
}

/* 1: a step id as the lane writes it (None, or an int of 64 bits: *value), 0: not one. */
static int
step_value(PyObject *step_id, long long *value)
{
    *value = 0;
    if (step_id == Py_None)
        return 1;
    if (!PyLong_CheckExact(step_id))
        return 0;
    int overflow = 0;
    *value = PyLong_AsLongLongAndOverflow(step_id, &overflow);
    return !overflow; /* an exact int raises nothing else */
}

/* Whether a line of a body and a tail this long may go into the map now: the lane open, a map
 * attached, room for the line with its header's bound, `room` within the map and `seq` below
 * its last value (fields Python sets: a wrong one is declined, never written through). Asked
 * before the lock and again under it. */
static int
fits(LaneState *self, Py_ssize_t body_len, Py_ssize_t tail_len)
{
    return self->open && self->attached && body_len >= 2 && self->room <= self->view.len &&
           self->room >= HEAD_MAX + body_len + tail_len + 2 && self->seq < LLONG_MAX;
}

/* Under the lock: let it go and decline (the Python method writes). */
static PyObject *
decline_locked(LaneState *self)
{
    PyObject *released = PyObject_CallNoArgs(self->release);
    if (released == NULL)
        return NULL;
    Py_DECREF(released);
    Py_RETURN_FALSE;
}

static PyObject *
lane_write(LaneState *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 2 || nargs > 3) {
        PyErr_SetString(PyExc_TypeError, "write(step_id, body, tail=b'')");
        return NULL;
    }
    PyObject *step_id = args[0], *body = args[1], *tail = nargs > 2 ? args[2] : NULL;
    long long value, last;
#ifndef __linux__
    /* CLOCK_MONOTONIC is time.monotonic_ns's clock on Linux only: elsewhere the method writes */
    Py_RETURN_FALSE;
#endif
    if (self->acquire == NULL || self->step == NULL || self->state == NULL ||
        self->step_t < 0 /* a time of the clock: now - step_t cannot overflow */ || !PyBytes_CheckExact(body) ||
        (tail != NULL && !PyBytes_CheckExact(tail)) || !step_value(step_id, &value))
        Py_RETURN_FALSE;
    Py_ssize_t body_len = PyBytes_GET_SIZE(body), tail_len = tail != NULL ? PyBytes_GET_SIZE(tail) : 0;
    if (!fits(self, body_len, tail_len))
        Py_RETURN_FALSE;
    if (self->deferred != NULL) {
        Py_ssize_t waiting = PyObject_Length(self->deferred);
        if (waiting != 0)
            return waiting < 0 ? NULL : Py_NewRef(Py_False);
    }
    Edge *edge;
    if (find_edge(self, body, &edge) < 0)
        return NULL;
    PyObject *taken = PyObject_CallOneArg(self->acquire, Py_False);
    if (taken == NULL)
        return NULL;
    int acquired = taken == Py_True;
    Py_DECREF(taken);
    if (!acquired) /* another thread writes: the Python method waits for it */
        Py_RETURN_FALSE;
    /* The lock is held: from here to its release nothing is allocated or freed, and no Python
     * code runs. Taking it may have run some (a collection): look again at what that could
     * change. The body is the short one where the edge chains on from the last `dst`. */
    if (edge != NULL && edge->shortened != NULL &&
        (edge->src == self->state || (PyUnicode_CheckExact(edge->src) && PyUnicode_CheckExact(self->state) &&
                                      PyUnicode_Compare(edge->src, self->state) == 0))) {
        body = edge->shortened;
        body_len = PyBytes_GET_SIZE(body);
    }
    PyObject *step = self->step;
    int changed;
    if (!fits(self, body_len, tail_len))
        changed = -1;
    else if (step == new_step)
        changed = 1;
    else if (step == step_id)
        changed = 0;
    else if (step == Py_None || step_id == Py_None)
        changed = 1;
    else if (step_value(step, &last))
        changed = last != value;
    else
        changed = -1; /* a step of the Python method's that is no int of 64 bits */
    if (changed < 0)
        return decline_locked(self);
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts); /* time.monotonic_ns's clock */
    long long now = (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
    char head[HEAD_MAX + 1];
    int head_len;
    if (!changed)
        head_len = snprintf(head, sizeof head, "{\"t\":%lld,", floor_us(now - self->step_t));
    else if (step_id == Py_None)
        head_len = snprintf(head, sizeof head, "{\"s\":null,\"q\":%lld,\"t\":%lld,", self->seq,
                            floor_us(now - self->step_t));
    else
        head_len = snprintf(head, sizeof head, "{\"s\":%lld,\"q\":%lld,\"t\":%lld,", value, self->seq,
                            floor_us(now - self->step_t));
    if (head_len < 0 || head_len >= (int)sizeof head) /* cannot be (73 at the most); never written cut */
        return decline_locked(self);
    char *start = (char *)self->view.buf + (self->view.len - self->room), *out = start;
    memcpy(out, head, (size_t)head_len);
    out += head_len;
    /* tail: head + body[1:-1] + tail + "}\n"; else head + body[1:] + "\n" */
    Py_ssize_t middle = tail_len ? body_len - 2 : body_len - 1;
    memcpy(out, PyBytes_AS_STRING(body) + 1, (size_t)middle);
    out += middle;
    if (tail_len) {
        memcpy(out, PyBytes_AS_STRING(tail), (size_t)tail_len);
        out += tail_len;
        *out++ = '}';
    }
    *out++ = '\n';
    self->room -= out - start;
    self->seq += 1;
    PyObject *old_step = NULL, *old_state = NULL; /* let go after the lock: freeing may run code */
    if (changed) {
        self->step_t = now;
        old_step = self->step;
        self->step = Py_NewRef(step_id);
    }
    if (edge != NULL) {
        old_state = self->state;
        self->state = Py_NewRef(edge->dst);
    }
    PyObject *released = PyObject_CallNoArgs(self->release);
    Py_XDECREF(old_step);
    Py_XDECREF(old_state);
    if (released == NULL)
        return NULL;
    Py_DECREF(released);
    Py_RETURN_TRUE;
}

/* -- the fields, for the Python code that shares them */

static PyObject *
get_long(LaneState *self, void *offset)
{
    return PyLong_FromLongLong(*(long long *)((char *)self + (Py_ssize_t)offset));
}

static int
set_long(LaneState *self, PyObject *value, void *offset)
{
    if (value == NULL) {
        PyErr_SetString(PyExc_AttributeError, "cannot delete a LaneState field");
        return -1;
    }
    long long v = PyLong_AsLongLong(value);
    if (v == -1 && PyErr_Occurred())
        return -1;
    *(long long *)((char *)self + (Py_ssize_t)offset) = v;
    return 0;
}

static PyObject *
get_object(LaneState *self, void *offset)
{
    PyObject *value = *(PyObject **)((char *)self + (Py_ssize_t)offset);
    return Py_NewRef(value != NULL ? value : Py_None); /* NULL: made by __new__ without __init__ */
}

static int
set_object(LaneState *self, PyObject *value, void *offset)
{
    if (value == NULL) {
        PyErr_SetString(PyExc_AttributeError, "cannot delete a LaneState field");
        return -1;
    }
    Py_INCREF(value);
    Py_XSETREF(*(PyObject **)((char *)self + (Py_ssize_t)offset), value);
    return 0;
}

static PyObject *
get_open(LaneState *self, void *Py_UNUSED(closure))
{
    return PyBool_FromLong(self->open);
}

static int
set_open(LaneState *self, PyObject *value, void *Py_UNUSED(closure))
{
    int truth = value == NULL ? -1 : PyObject_IsTrue(value);
    if (truth < 0) {
        if (value == NULL)
            PyErr_SetString(PyExc_AttributeError, "cannot delete a LaneState field");
        return -1;
    }
    self->open = truth;
    return 0;
}

static PyObject *
get_attached(LaneState *self, void *Py_UNUSED(closure))
{
    return PyBool_FromLong(self->attached);
}

#define FIELD(name, kind, doc) \
    {#name, (getter)get_##kind, (setter)set_##kind, doc, (void *)offsetof(LaneState, name)}

static PyGetSetDef lane_fields[] = {
    FIELD(seq, long, "the seq the log's next record gets"),
    FIELD(step, object, "the step of the segment's last record (compact._NEW_STEP: none yet)"),
    FIELD(step_t, long, "the time of that step's first record (ns)"),
    FIELD(state, object, "the segment's last transition's dst, or None"),
    FIELD(room, long, "bytes mapped and not written yet"),
    {"open", (getter)get_open, (setter)set_open, "whether `write` may write (the log's lane)", NULL},
    {"attached", (getter)get_attached, NULL, "whether a map is attached", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef lane_methods[] = {
    {"write", (PyCFunction)(void (*)(void))lane_write, METH_FASTCALL,
     "write(step_id, body, tail=b''): one transition, as AuditLog.step_transition writes it; False where"
     " that method must"},
    {"attach", (PyCFunction)lane_attach, METH_O, "attach(mapping): the map to write into"},
    {"detach", (PyCFunction)lane_detach, METH_NOARGS, "let the map go (before it is resized or closed)"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject LaneStateType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "runner_fsm.audit._step_lane.LaneState",
    .tp_basicsize = sizeof(LaneState),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A log's step lane: its seq, its renderer's step and state, its file's room and map.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)lane_init,
    .tp_dealloc = (destructor)lane_dealloc,
    .tp_methods = lane_methods,
    .tp_getset = lane_fields,
};

/* -- a step's decisions digested: `decisions.decide` is the reference.
 *
 * `hash(tuple(map(tuple, sampled)))` and `hash((*values, tokens))` built 18 tuples a step and
 * went through the interpreter's generic paths, cold right after vLLM's sampler (~9 us a step
 * with the tail's format, measured in vLLM: docs/vllm.md, the fifth pass). Here the tuple hash
 * is combined as the interpreter combines it (Objects/tupleobject.c, xxHash's, the same since
 * CPython 3.8) from each item's own hash, without building the tuples. `decisions` checks it
 * against the Python one before using it: it is asserted there, not assumed here. */
#if SIZEOF_SIZE_T > 4
#define XXPRIME_1 ((Py_uhash_t)11400714785074694791ULL)
#define XXPRIME_2 ((Py_uhash_t)14029467366897019727ULL)
#define XXPRIME_5 ((Py_uhash_t)2870177450012600261ULL)
#define XXROTATE(x) (((x) << 31) | ((x) >> 33))
#else
#define XXPRIME_1 ((Py_uhash_t)2654435761UL)
#define XXPRIME_2 ((Py_uhash_t)2246822519UL)
#define XXPRIME_5 ((Py_uhash_t)374761393UL)
#define XXROTATE(x) (((x) << 13) | ((x) >> 19))
#endif
#define DIGEST_MASK 0xFFFFFFFFULL

typedef struct {
    Py_uhash_t acc;
    Py_ssize_t len;
} TupleHash;

static void
tuple_hash_add(TupleHash *h, Py_uhash_t lane)
{
    h->acc += lane * XXPRIME_2;
    h->acc = XXROTATE(h->acc);
    h->acc *= XXPRIME_1;
    h->len += 1;
}

static Py_hash_t
tuple_hash_end(TupleHash *h)
{
    Py_uhash_t acc = h->acc + ((Py_uhash_t)h->len ^ (XXPRIME_5 ^ 3527539UL));
    return acc == (Py_uhash_t)-1 ? 1546275796 : (Py_hash_t)acc;
}

/* Each item of `seq` (an exact list or tuple) into `h`, by `item_hash`; -1 on an error. A
 * list's size is read each time round: an item's __hash__ may change it (tuple() would have
 * copied it first; an item's hash that changes its list is not a digest's concern). */
static int
add_items(TupleHash *h, PyObject *seq, Py_hash_t (*item_hash)(PyObject *))
{
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); i++) {
        PyObject *item = Py_NewRef(PySequence_Fast_GET_ITEM(seq, i));
        Py_hash_t lane = item_hash(item);
        Py_DECREF(item);
        if (lane == -1)
            return -1;
        tuple_hash_add(h, (Py_uhash_t)lane);
    }
    return 0;
}

/* hash(tuple(seq)): a list's or a tuple's items as they are, anything else through tuple() */
static Py_hash_t
hash_as_tuple(PyObject *seq)
{
    if (!PyList_CheckExact(seq) && !PyTuple_CheckExact(seq)) {
        PyObject *made = PySequence_Tuple(seq);
        if (made == NULL)
            return -1;
        Py_hash_t hash = PyObject_Hash(made);
        Py_DECREF(made);
        return hash;
    }
    TupleHash h = {XXPRIME_5, 0};
    return add_items(&h, seq, PyObject_Hash) < 0 ? -1 : tuple_hash_end(&h);
}

/* `decisions.tokens_digest(sampled) if sampled else 0` for None or vLLM's list of token lists */
static int
tokens_of(PyObject *sampled, unsigned long long *tokens)
{
    *tokens = 0;
    if (sampled == Py_None)
        return 0;
    if (!PyList_CheckExact(sampled)) { /* another form (a dict of the embedded engine's): the reference's */
        int truth = PyObject_IsTrue(sampled);
        if (truth <= 0)
            return truth;
        PyObject *module = PyImport_ImportModule("runner_fsm.audit.decisions");
        if (module == NULL)
            return -1;
        PyObject *digest = PyObject_CallMethod(module, "tokens_digest", "O", sampled);
        Py_DECREF(module);
        if (digest == NULL)
            return -1;
        *tokens = PyLong_AsUnsignedLongLongMask(digest);
        Py_DECREF(digest);
        return PyErr_Occurred() ? -1 : 0;
    }
    if (PyList_GET_SIZE(sampled) == 0)
        return 0;
    TupleHash h = {XXPRIME_5, 0};
    if (add_items(&h, sampled, hash_as_tuple) < 0)
        return -1;
    *tokens = (unsigned long long)tuple_hash_end(&h) & DIGEST_MASK;
    return 0;
}

/* decide(values, sampled, last) -> (tokens, digest, tail or None): `decisions.decide` for what
 * the recorder hands it (`values` an exact tuple, `last` one or None); a `last` of another type
 * is taken as changed, which only costs the tail's render by name */
static PyObject *
decide(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3 || !PyTuple_CheckExact(args[0])) {
        PyErr_SetString(PyExc_TypeError, "decide(values: tuple, sampled, last)");
        return NULL;
    }
    PyObject *values = args[0], *last = args[2];
    unsigned long long tokens;
    if (tokens_of(args[1], &tokens) < 0)
        return NULL;
    TupleHash h = {XXPRIME_5, 0};
    Py_ssize_t count = PyTuple_GET_SIZE(values);
    if (add_items(&h, values, PyObject_Hash) < 0)
        return NULL;
#if SIZEOF_SIZE_T > 4
    tuple_hash_add(&h, (Py_uhash_t)tokens); /* an int below 2**61 - 1 (the modulus) hashes as itself */
#else
    tuple_hash_add(&h, (Py_uhash_t)(tokens % 2147483647ULL)); /* a non-negative int: itself mod 2**31 - 1 */
#endif
    unsigned long long digest = (unsigned long long)tuple_hash_end(&h) & DIGEST_MASK;
    int unchanged = last == values;
    if (!unchanged && PyTuple_CheckExact(last) && PyTuple_GET_SIZE(last) == count) {
        unchanged = 1;
        for (Py_ssize_t i = 0; i < count && unchanged; i++) {
            unchanged = PyObject_RichCompareBool(PyTuple_GET_ITEM(values, i), PyTuple_GET_ITEM(last, i), Py_EQ);
            if (unchanged < 0)
                return NULL;
        }
    }
    PyObject *tail;
    if (unchanged) {
        char text[32];
        int len = snprintf(text, sizeof text, ",\"dg\":%llu", digest);
        tail = PyBytes_FromStringAndSize(text, len);
    } else {
        tail = Py_NewRef(Py_None);
    }
    if (tail == NULL)
        return NULL;
    PyObject *out = PyTuple_New(3), *tokens_obj = PyLong_FromUnsignedLongLong(tokens),
             *digest_obj = PyLong_FromUnsignedLongLong(digest);
    if (out == NULL || tokens_obj == NULL || digest_obj == NULL) {
        Py_XDECREF(out);
        Py_XDECREF(tokens_obj);
        Py_XDECREF(digest_obj);
        Py_DECREF(tail);
        return NULL;
    }
    PyTuple_SET_ITEM(out, 0, tokens_obj);
    PyTuple_SET_ITEM(out, 1, digest_obj);
    PyTuple_SET_ITEM(out, 2, tail);
    return out;
}

/* configure(edges, new_step): compact._EDGES and compact._NEW_STEP, once, before any LaneState. */
static PyObject *
configure(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 || !PyDict_CheckExact(args[0])) {
        PyErr_SetString(PyExc_TypeError, "configure(edges: dict, new_step)");
        return NULL;
    }
    Py_XSETREF(edges, Py_NewRef(args[0]));
    Py_XSETREF(new_step, Py_NewRef(args[1]));
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"configure", (PyCFunction)(void (*)(void))configure, METH_FASTCALL,
     "configure(edges, new_step): compact._EDGES and compact._NEW_STEP."},
    {"decide", (PyCFunction)(void (*)(void))decide, METH_FASTCALL,
     "decide(values, sampled, last) -> (tokens, digest, tail or None): decisions.decide, compiled."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_step_lane", "The step lane's state, and its write in C.", -1, module_methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__step_lane(void)
{
    if (PyType_Ready(&LaneStateType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddStringConstant(m, "SOURCE_DIGEST", STEP_LANE_SOURCE_DIGEST) < 0 ||
        PyModule_AddObjectRef(m, "LaneState", (PyObject *)&LaneStateType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
