# Static types for the compiled form of entries.py (the .py file stays the one source).
cdef class TensorTable:
    cdef public object _entries, _lock
