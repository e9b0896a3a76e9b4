# Static types for the compiled form of cache_protocol.py (the .py file stays the one source).
# SlotTable stays a Python class: the schedule explorer counts evictions by wrapping its insert().
cdef class CacheProtocol:
    cdef public object table
    cdef public object dormant_after_s, withdraw_after_s, phase, _slept_in, peer_left, pending, waiting, queued
    cdef public object _queued_keys, withdrawn, payload, _recent, _ran_at, outgoing, last_activity
    cdef public object cycles_done, events, dormant_events, joins_completed, _runs
    cdef public bint closing, join_requested, enabled, wake_sent, _payload_stale
