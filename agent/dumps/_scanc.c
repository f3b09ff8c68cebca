#define PY_SSIZE_T_CLEAN
#include <Python.h>
static struct PyModuleDef D = {PyModuleDef_HEAD_INIT, "_scanc", NULL, -1, NULL};
PyMODINIT_FUNC PyInit__scanc(void) { return PyModule_Create(&D); }
