# Static types for the compiled form of handles.py (the .py file stays the one source; Cython reads both).
cdef class Handle:
    cdef public object id, name, _gate, _result, _error, _lock, _finish, _events
    cdef public bint _finished
    cdef public Py_ssize_t _remaining

cdef class HandleTable:
    cdef public object _handles, _ids, _lock
