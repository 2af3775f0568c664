/* A repeated call, run from its plan in C: pyhipa2a.repeat's compiled executor.
 *
 * A plan (pyhipa2a/repeat.py says what each field holds) is a tuple:
 *   (given, alike, checks, status, activate, waits, launch, after, changes, result, failed, places, rehand,
 *    stood)
 * run(plan, *args) asks its checks and does its steps in the order pyhipa2a.repeat.interpret does, and
 * returns the call's result, or MISSED having done nothing. Driver calls named by address (CUDA's
 * context and graph launch) run with the GIL released, as the binding's own calls do.
 *
 * Built with the limited API (one .so for every CPython >= 3.10): `python -m pyhipa2a.build`.
 */
#define Py_LIMITED_API 0x030A0000
#include <Python.h>
#include <stdint.h>

enum { ATTR_IS = 0, ATTR_IS_OR_NONE = 1, CALL_IS = 2, CALL_EQ = 3 };
enum { GIVEN, ALIKE, CHECKS, STATUS, ACTIVATE, WAITS, LAUNCH, AFTER, CHANGES, RESULT, FAILED, PLACES, REHAND,
       STOOD, PLAN_FIELDS };
enum { MAX_PLACES = 8 };
/* The forms of a change it reads: 2 since (obj, name, value, i), the call's argument i */
enum { PLAN_FORMS = 2 };

/* A pointer this call's argument puts in the launch's arguments, and where. */
typedef struct {
    uint64_t *address;
    uint64_t pointer;
} Place;

typedef int (*ctx_get_fn)(void **);
typedef int (*ctx_set_fn)(void *);
typedef int (*graph_launch_fn)(void *, void *);

static PyObject *missed;

/* 1: passes; 0: misses (an Exception raised on the way is cleared); -1: a BaseException that is
 * not an Exception (KeyboardInterrupt, SystemExit) goes on up. */
static int outcome_of_error(void) {
    if (PyErr_ExceptionMatches(PyExc_Exception)) {
        PyErr_Clear();
        return 0;
    }
    return -1;
}

static int check_passes(PyObject *check) {
    PyObject *a = PyTuple_GetItem(check, 1), *b = PyTuple_GetItem(check, 2), *want = PyTuple_GetItem(check, 3);
    long kind = PyLong_AsLong(PyTuple_GetItem(check, 0));
    if (kind == ATTR_IS || kind == ATTR_IS_OR_NONE) {
        PyObject *got = PyObject_GetAttr(a, b);
        if (got == NULL)
            return outcome_of_error();
        int passes = got == want || (kind == ATTR_IS_OR_NONE && got == Py_None);
        Py_DECREF(got);
        return passes;
    }
    PyObject *got = PyObject_CallFunctionObjArgs(a, b, NULL);
    if (got == NULL)
        return outcome_of_error();
    int passes = got == want;
    if (kind == CALL_EQ) {
        passes = PyObject_RichCompareBool(got, want, Py_EQ);
        if (passes < 0)
            passes = outcome_of_error();
    }
    Py_DECREF(got);
    return passes;
}

/* 1 with the arguments' pointers in places[0 .. *count) where they have places; 0: misses. */
static int arguments_pass(PyObject *plan, PyObject *const *args, Py_ssize_t nargs, Place *places, int *count) {
    PyObject *given = PyTuple_GetItem(plan, GIVEN), *alike = PyTuple_GetItem(plan, ALIKE);
    PyObject *where = PyTuple_GetItem(plan, PLACES), *stood = PyTuple_GetItem(plan, STOOD);
    Py_ssize_t placed = PyTuple_Size(where);
    if (PyTuple_Size(given) != nargs || (placed != 0 && (placed != nargs || nargs > MAX_PLACES
                                                         || !PyList_Check(stood) || PyList_Size(stood) != nargs)))
        return 0;
    *count = 0;
    for (Py_ssize_t i = 0; i < nargs; i++) {
        PyObject *recorded = PyTuple_GetItem(given, i);
        PyObject *place = placed ? PyTuple_GetItem(where, i) : Py_None;
        uint64_t pointer;
        if (args[i] == recorded) {
            if (place == Py_None)
                continue;
            pointer = PyLong_AsUnsignedLongLong(PyTuple_GetItem(place, 1));
        } else {
            PyObject *same = PyTuple_GetItem(alike, i);
            if (same == Py_None || (place != Py_None && PyList_GetItem(stood, i) == args[i]))
                return 0;
            PyObject *answer = PyObject_CallFunctionObjArgs(same, args[i], recorded, NULL);
            if (answer == NULL)
                return outcome_of_error();
            int truth = PyObject_IsTrue(answer);
            if (truth <= 0) {
                Py_DECREF(answer);
                return truth < 0 ? outcome_of_error() : 0;
            }
            if (place == Py_None) {
                Py_DECREF(answer);
                continue;
            }
            pointer = PyLong_AsUnsignedLongLong(answer);
            Py_DECREF(answer);
        }
        if (PyErr_Occurred())
            return outcome_of_error();
        places[*count].address = (uint64_t *)PyLong_AsVoidPtr(PyTuple_GetItem(place, 0));
        places[*count].pointer = pointer;
        ++*count;
    }
    return 1;
}

static void *address(PyObject *tuple, Py_ssize_t i) {
    return PyLong_AsVoidPtr(PyTuple_GetItem(tuple, i));
}

/* Calls plan's failed(what, code); NULL with what it raised (a RuntimeError where it did not). */
static PyObject *driver_failed(PyObject *plan, const char *what, int code) {
    PyObject *answer = PyObject_CallFunction(PyTuple_GetItem(plan, FAILED), "si", what, code);
    if (answer != NULL) {
        Py_DECREF(answer);
        PyErr_Format(PyExc_RuntimeError, "%s failed (%d)", what, code);
    }
    return NULL;
}

/* The launch function raised: plan's failed("launch", None) is told, then what the launch raised goes
 * on up (or what failed() raised, where it did). */
static PyObject *launch_failed(PyObject *plan) {
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    PyObject *answer = PyObject_CallFunction(PyTuple_GetItem(plan, FAILED), "sO", "launch", Py_None);
    if (answer == NULL) {
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(traceback);
        return NULL;
    }
    Py_DECREF(answer);
    PyErr_Restore(type, value, traceback);
    return NULL;
}

static int call_back(PyObject *f, PyObject *arg) {
    PyObject *answer = PyObject_CallFunctionObjArgs(f, arg, NULL);
    if (answer == NULL)
        return -1;
    Py_DECREF(answer);
    return 0;
}

/* f() for each f of a tuple; -1 with what one raised. */
static int call_each(PyObject *functions) {
    for (Py_ssize_t i = 0, n = PyTuple_Size(functions); i < n; i++) {
        PyObject *answer = PyObject_CallNoArgs(PyTuple_GetItem(functions, i));
        if (answer == NULL)
            return -1;
        Py_DECREF(answer);
    }
    return 0;
}

/* run(plan, *args): the call's result, or MISSED. */
static PyObject *run(PyObject *self, PyObject *const *argv, Py_ssize_t argc) {
    (void)self;
    if (argc < 1 || !PyTuple_Check(argv[0]) || PyTuple_Size(argv[0]) != PLAN_FIELDS) {
        PyErr_SetString(PyExc_TypeError, "run(plan, *args): plan is a tuple of 14 fields");
        return NULL;
    }
    PyObject *plan = argv[0];
    Place places[MAX_PLACES];
    int placed = 0;
    int passes = arguments_pass(plan, argv + 1, argc - 1, places, &placed);
    PyObject *checks = PyTuple_GetItem(plan, CHECKS);
    for (Py_ssize_t i = 0, n = PyTuple_Size(checks); passes > 0 && i < n; i++)
        passes = check_passes(PyTuple_GetItem(checks, i));
    if (passes < 0)
        return NULL;
    if (passes == 0)
        return Py_NewRef(missed);
    void *status = PyLong_AsVoidPtr(PyTuple_GetItem(plan, STATUS));
    if (status != NULL && *(volatile uint32_t *)status != 0)
        return Py_NewRef(missed);

    PyObject *activate = PyTuple_GetItem(plan, ACTIVATE);
    if (activate != Py_None) {
        if (PyTuple_Size(activate) == 1) {
            PyObject *answer = PyObject_CallNoArgs(PyTuple_GetItem(activate, 0));
            if (answer == NULL)
                return NULL;
            Py_DECREF(answer);
        } else {
            void *current = NULL, *context = address(activate, 2);
            ctx_get_fn get = (ctx_get_fn)address(activate, 0);
            ctx_set_fn set = (ctx_set_fn)address(activate, 1);
            int code;
            Py_BEGIN_ALLOW_THREADS  /* (as the binding's calls: other threads run meanwhile) */
            code = get(&current);
            if (code != 0 || current != context)
                code = set(context);
            Py_END_ALLOW_THREADS
            if (code != 0)
                return driver_failed(plan, "cuCtxSetCurrent", code);
        }
    }
    if (call_each(PyTuple_GetItem(plan, WAITS)) < 0)
        return NULL;
    int moved = 0;
    for (int i = 0; i < placed; i++) {
        if (*places[i].address != places[i].pointer) {
            *places[i].address = places[i].pointer;
            moved = 1;
        }
    }
    PyObject *rehand = PyTuple_GetItem(plan, REHAND);
    if (moved && rehand != Py_None) {
        PyObject *answer = PyObject_CallNoArgs(rehand);
        if (answer == NULL)
            return launch_failed(plan);
        Py_DECREF(answer);
    }
    PyObject *launch = PyTuple_GetItem(plan, LAUNCH);
    if (PyTuple_Size(launch) == 2) {
        if (call_back(PyTuple_GetItem(launch, 0), PyTuple_GetItem(launch, 1)) < 0)
            return launch_failed(plan);
    } else {
        graph_launch_fn graph_launch = (graph_launch_fn)address(launch, 0);
        void *graph = address(launch, 1), *stream = address(launch, 2);
        int code;
        Py_BEGIN_ALLOW_THREADS
        code = graph_launch(graph, stream);
        Py_END_ALLOW_THREADS
        if (code != 0)
            return driver_failed(plan, "cuGraphLaunch", code);
    }
    if (call_each(PyTuple_GetItem(plan, AFTER)) < 0)
        return NULL;
    PyObject *changes = PyTuple_GetItem(plan, CHANGES);
    for (Py_ssize_t i = 0, n = PyTuple_Size(changes); i < n; i++) {
        PyObject *change = PyTuple_GetItem(changes, i), *value = PyTuple_GetItem(change, 2), *pair = NULL;
        if (PyTuple_Size(change) == 4 && PyTuple_GetItem(change, 3) != Py_None) {
            /* (obj, name, value, i): the call's argument i */
            Py_ssize_t index = PyLong_AsSsize_t(PyTuple_GetItem(change, 3));
            if (index < 0 || index >= argc - 1) {
                if (!PyErr_Occurred())
                    PyErr_SetString(PyExc_IndexError, "a plan's change names no argument of the call");
                return NULL;
            }
            value = argv[1 + index];
        } else if (PyTuple_Size(change) == 4) {  /* (obj, name, value, None): (the call's arguments, value) */
            PyObject *arguments = PyTuple_New(argc - 1);
            if (arguments == NULL)
                return NULL;
            for (Py_ssize_t j = 1; j < argc; j++)
                PyTuple_SetItem(arguments, j - 1, Py_NewRef(argv[j]));
            pair = PyTuple_Pack(2, arguments, value);
            Py_DECREF(arguments);
            if (pair == NULL)
                return NULL;
            value = pair;
        }
        int set = PyObject_SetAttr(PyTuple_GetItem(change, 0), PyTuple_GetItem(change, 1), value);
        Py_XDECREF(pair);
        if (set < 0)
            return NULL;
    }
    PyObject *where = PyTuple_GetItem(plan, PLACES), *given = PyTuple_GetItem(plan, GIVEN);
    PyObject *stood = PyTuple_GetItem(plan, STOOD);
    for (Py_ssize_t i = 0, n = PyTuple_Size(where); i < n; i++) {
        int stood_in = PyTuple_GetItem(where, i) != Py_None && argv[1 + i] != PyTuple_GetItem(given, i);
        if (PyList_SetItem(stood, i, Py_NewRef(stood_in ? argv[1 + i] : Py_None)) < 0)
            return NULL;
    }
    return Py_NewRef(PyTuple_GetItem(plan, RESULT));
}

static PyMethodDef methods[] = {
    {"run", (PyCFunction)(void (*)(void))run, METH_FASTCALL, "run(plan, *args): the call's result, or MISSED"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_repeat", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__repeat(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    missed = PyObject_CallNoArgs((PyObject *)&PyBaseObject_Type);
    /* PLAN_FIELDS, PLAN_FORMS: pyhipa2a.repeat loads no helper built for another plan's layout or forms */
    if (missed == NULL || PyModule_AddObjectRef(m, "MISSED", missed) < 0
            || PyModule_AddIntConstant(m, "PLAN_FIELDS", PLAN_FIELDS) < 0
            || PyModule_AddIntConstant(m, "PLAN_FORMS", PLAN_FORMS) < 0) {
        Py_CLEAR(missed);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
