"""The rendezvous store's calls a pod's hang watchdog makes (torch's TCPStore has them), on a dict: for the
watchdog's tests (test_hang_watchdog.py, test_watchdog_peers.py)."""

from __future__ import annotations


class Store:
    """The rendezvous store's calls the watchdog makes (torch's TCPStore has them), on a dict."""

    def __init__(self):
        self.data: dict[str, bytes] = {}

    def set(self, key, value):
        self.data[key] = value.encode() if isinstance(value, str) else value

    def check(self, keys):
        return all(k in self.data for k in keys)

    def get(self, key):
        return self.data[key]

    def multi_get(self, keys):
        return [self.data[k] for k in keys]

    def delete_key(self, key):
        return self.data.pop(key, None) is not None
