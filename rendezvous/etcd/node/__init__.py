"""What every agent of the etcd backend does for itself, on the session it borrows (core/):
register under a readable node id, join rounds, check the job's settings, and take
part in the end of a round or of the run. Nothing here decides a round: leader/ does.
"""
