"""Downloads: a job (with its repair), fetch and scheduling, the range reader, mirrors, the journal,
hashing.
"""
