"""What the oldest agent of the etcd backend does for all: the election, the driver actor that
runs a leader's term, and the term itself (decide, then apply one fenced Txn), with what a
decision needs beside the round (departures, the first round's last call, repairs).
"""
