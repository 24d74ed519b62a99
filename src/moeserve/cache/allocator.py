"""Fixed-size page allocator for the paged KV cache, with the prefix cache's page index
(plain Python, no torch).

Every page is in exactly one of three states:

* **free**: on the free list, holding nothing anyone may read;
* **in use**: referenced by one or more sequences (``refcount > 0``); it may also be *cached*
  (in the index under its :data:`PageHash`), in which case new sequences may map it too;
* **cached and unreferenced**: in the index with ``refcount == 0``, kept on an LRU list until
  memory is needed. ``allocate`` takes free pages first, then evicts these, least recently
  released first. A page in use is never evicted.

``num_free`` counts the free and the evictable pages: both can be handed out now.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Iterable, Sequence as Seq

# A full page of tokens is known by a hash chained over its parent page's hash and its own
# token ids, so equal hashes mean equal tokens in the same positions from the start of the
# sequence. The index is keyed by that hash and holds each page's key (parent hash, its own
# token ids), which a lookup compares: a page's own tokens are compared exactly, only its
# ancestry is trusted to the 64-bit hash (as vLLM's default). (Keyed by the hash, a lookup
# hashes each page's tokens once, not again inside the dict.)
PageHash = int
PageKey = tuple[PageHash, tuple[int, ...]]
ROOT_HASH: PageHash = 0


def page_key(parent: PageHash, tokens: Seq[int]) -> PageKey:
    return parent, tuple(tokens)


def page_hash(key: PageKey) -> PageHash:
    return hash(key)


def salted_root(cache_salt: str | None) -> PageHash:
    """The parent hash of a sequence's first page: a request's ``cache_salt`` (vLLM's field)
    starts its chain apart, so requests of different salts never share a page (and the
    ``cached_tokens`` they see cannot tell one client what another sent)."""
    return ROOT_HASH if cache_salt is None else hash(("cache_salt", cache_salt))


def chain_hashes(
    token_ids: Seq[int], page_size: int, num_pages: int, known: list[PageHash] | None = None, root: PageHash = ROOT_HASH
) -> list[PageHash]:
    """The hashes of the first ``num_pages`` full pages of ``token_ids`` (the first one's parent
    is ``root``); ``known`` (the hashes of a prefix of them, computed before) is extended in
    place and returned."""
    hashes = known if known is not None else []
    for i in range(len(hashes), num_pages):
        parent = hashes[i - 1] if i else root
        hashes.append(page_hash(page_key(parent, token_ids[i * page_size : (i + 1) * page_size])))
    return hashes


class OutOfPages(Exception):
    pass


class PagedAllocator:
    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"need at least one page of at least one token (got {num_pages} x {page_size})")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free: deque[int] = deque(range(num_pages))
        self._refs = [0] * num_pages
        self._index: dict[PageHash, tuple[PageKey, int]] = {}  # cached pages: hash -> (key, page)
        self._hash_of: dict[int, PageHash] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced: LRU first

    @property
    def num_free(self) -> int:
        """Pages ``allocate`` can hand out now (free ones and evictable cached ones)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        return len(self._index)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_pages

    def refcount(self, page: int) -> int:
        return self._refs[page]

    def is_cached(self, page: int) -> bool:
        return page in self._hash_of

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise OutOfPages(f"asked for {n} pages, {self.num_free} free")
        pages = []
        for _ in range(n):
            if self._free:
                page = self._free.popleft()
            else:
                page, _ = self._evictable.popitem(last=False)
                del self._index[self._hash_of.pop(page)]
            self._refs[page] = 1
            pages.append(page)
        return pages

    def free(self, pages: Iterable[int]) -> None:
        """Drop one reference to each page. Pass a sequence's pages in order: the tail is
        released first, so it is evicted before the prefix that other prompts share."""
        for page in reversed(list(pages)):
            self._refs[page] -= 1
            if self._refs[page] < 0:
                raise AssertionError(f"page {page} freed more often than it was referenced")
            if self._refs[page]:
                continue
            if page in self._hash_of:
                self._evictable[page] = None
            else:
                self._free.append(page)

    # ---- the prefix index ----
    def lookup(self, token_ids: Seq[int], num_pages: int, known: list[PageHash] | None = None, root: PageHash = ROOT_HASH) -> list[int]:
        """The cached pages of the longest run of ``token_ids``' first ``num_pages`` full pages
        found in the index, from the first page on; no reference is taken. ``known`` (their
        hashes computed so far, as ``chain_hashes`` keeps them) is extended in place up to the
        first page not found: each page's key is built once, for its hash and its lookup."""
        hashes = known if known is not None else []
        ps, index = self.page_size, self._index
        pages = []
        for i in range(num_pages):
            key = page_key(hashes[i - 1] if i else root, token_ids[i * ps : (i + 1) * ps])
            if i == len(hashes):
                hashes.append(page_hash(key))
            entry = index.get(hashes[i])
            if entry is None or entry[0] != key:
                break
            pages.append(entry[1])
        return pages

    def num_evictable(self, pages: Iterable[int]) -> int:
        """How many of ``pages`` are cached and unreferenced (``acquire`` takes them off the
        free count)."""
        return sum(1 for p in pages if p in self._evictable)

    def acquire(self, pages: Iterable[int]) -> None:
        """Take one reference to each of these cached pages."""
        for page in pages:
            self._evictable.pop(page, None)
            self._refs[page] += 1

    def cache(self, page: int, parent: PageHash, tokens: Seq[int]) -> None:
        """Index a full page whose KV is written (see the scheduler for when that is). A page
        with the same tokens cached already keeps its place; this one stays private."""
        key = page_key(parent, tokens)
        h = page_hash(key)
        if h in self._index or page in self._hash_of:  # (or another key of this hash: this one stays private)
            return
        self._index[h] = (key, page)
        self._hash_of[page] = h

    def check(self) -> None:
        """Every page is in exactly one state (tests call this)."""
        free = set(self._free)
        assert len(free) == len(self._free), "a page is on the free list twice"
        for page in range(self.num_pages):
            states = [page in free, self._refs[page] > 0, page in self._evictable]
            assert sum(states) == 1, f"page {page}: free/in use/evictable = {states}"
            assert page not in self._evictable or page in self._hash_of
            assert page not in free or page not in self._hash_of
        assert all(self._index[h][1] == p for p, h in self._hash_of.items()) and len(self._index) == len(self._hash_of)
