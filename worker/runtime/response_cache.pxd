# Static types for the compiled form of response_cache.py (the .py file stays the one source).
cdef class ResponseCache:
    cdef public object comm, rank, capacity, _executor, _fusion_threshold, _cycle_time_s, _negotiate, _on_fatal
    cdef public object _lock, _driver, _last_cycle_at, _in_cycle_since, autotune, _thread, protocol
    cdef public bint _flush
    cdef public Py_ssize_t _callers, hits, carried
