"""/health's view of the cluster: ready when discovery lists a router, a decode worker and a
processor (or the processor's address is fixed in the config)."""

from __future__ import annotations

from services.common.address_book import AddressBook


class ClusterReadiness:
    def __init__(self, *books: AddressBook) -> None:
        self._books = books

    def ready(self) -> tuple[bool, str]:
        missing = [b.role for b in self._books if len(b) == 0]
        if missing:
            return False, "waiting for: " + ", ".join(missing)
        return True, ", ".join(f"{b.role}: {len(b)}" for b in self._books)
