"""The prefix cache of one data-parallel rank (Ray-free): latent pages of token blocks that requests computed, shared
by the requests whose prompts start with the same blocks, and KDA state checkpoints at every `every`-th token, so
that a request starts its prefill at the deepest boundary it shares with a cached prefix.

- Blocks: the page_size tokens of one latent page. A block's key chains its parent's (the block before it), as vLLM's
  block hashing does: key_i = blake2b(key_{i-1} + tokens_i). A block also keeps its tokens and its parent's key, and
  a lookup compares both, so a hash collision is a miss, never another prefix's cache.
- A cached block holds its page (written once, read by every request that shares it: a request writes only the
  positions past its prefix, which start on a page boundary) and, where its last token ends a multiple of `every`
  tokens, the checkpoint of every KDA layer's state (and short-convolution tail) after that token.
- Requests hold references on the cached blocks of their prefix: those of their hit, those they computed and
  cached, and those they computed that another request had cached first (their own page stays theirs). A request
  holds a block only with its parent, so a block nobody holds has no held descendant.
- A block nobody holds is evictable, least recently used first (a request lets go of its deepest blocks first, so
  the shallow ones, shared most, go last), and only as a leaf: a block stays while a child of it is cached, so every
  cached block's whole prefix is cached (a lookup walks it from the first block). Evicting a block frees its page
  and its checkpoint. Evictable pages cost nothing while the rank's page pool has free pages: they are taken back
  when its free pages run out.
- Checkpoints are the budget (`PrefixSizes`: they sit in memory of their own, beside the state slots; the cache's
  `StateCheckpoints` keeps them). One needed where none is free is taken from an evictable block, the block keeping
  its page: the least recently used one whose prefix has a deeper checkpoint cached below it (a chat's intermediate
  states), else the least recently used one. So a finished chat keeps the state at its deepest boundary, where its
  next turn resumes, the longest.

A request's hit is the deepest boundary b (a multiple of `every`, at most its length - 1: one token at least is
computed, for its logits) where every block before b is cached and the block ending at b holds a checkpoint.
Shapes: P page size, b a boundary in tokens.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

ROOT = b""  # the parent key of a prompt's first block
VICTIMS_SCANNED = 64  # evictable checkpointed blocks looked at for an intermediate state to take a checkpoint from
DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}


def block_key(parent: bytes, tokens) -> bytes:
    """The key of a block: its parent's key chained with its token ids."""
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


@dataclass(frozen=True)
class PrefixSizes:
    """every: tokens between KDA state checkpoints (a multiple of the page size); checkpoints: the checkpoint pool of
    a rank (on every worker of the rank, beside its KDA slots); page_bytes / checkpoint_bytes: the whole model's
    (every stage's layers)."""
    every: int
    checkpoints: int
    page_bytes: int
    checkpoint_bytes: int

    @property
    def state_bytes_per_token(self) -> float:
        """Bytes of state checkpoint per cached token (one checkpoint every `every` tokens)."""
        return self.checkpoint_bytes / self.every


def prefix_sizes(serve, model) -> PrefixSizes | None:
    """The prefix cache's sizes from serve.* (resolved) and the model config; None with serve.prefix_cache off.
    serve.prefix_cache_bytes (default: one checkpoint per state slot) buys checkpoints, each with the pages of the
    interval before it."""
    if not serve.prefix_cache:
        return None
    elem = DTYPE_BYTES[model.dtype]
    state_elem = 8 if elem == 8 else 4
    kda = sum(model.layer_kind(i) == "kda" for i in range(model.n_layers))
    mla = model.n_layers - kda
    h, H = model.kda_head_dim, model.n_heads
    checkpoint = kda * (H * h * h * state_elem + max(model.kda_conv_size - 1, 0) * 3 * H * h * elem)
    page = mla * serve.page_size * (model.kv_rank + model.mla_rope_dim) * elem
    pages_per_interval = serve.prefix_state_every // serve.page_size
    interval = checkpoint + pages_per_interval * page
    budget = serve.prefix_cache_bytes if serve.prefix_cache_bytes is not None else serve.slots_per_rank * interval
    n = max(1, budget // max(1, interval))
    return PrefixSizes(serve.prefix_state_every, n, page, checkpoint)


@dataclass
class Block:
    key: bytes
    parent: bytes
    tokens: tuple
    page: int
    refs: int = 0  # requests holding it
    checkpoint: int = -1  # the KDA state checkpoint after its last token (-1: none)
    children: int = 0  # cached blocks whose parent it is
    below: int = 0  # checkpoints held by the blocks under it (its descendants)


@dataclass
class Hit:
    """What a request reuses: its first `tokens` positions (a boundary), the pages holding them, the checkpoint of
    the state after them; `keys`: those pages' blocks. `shared`: the tokens of its prefix in cached blocks, with a
    checkpoint or not (>= tokens: where its prompt leaves the cached prefixes)."""
    tokens: int = 0
    pages: tuple = ()
    checkpoint: int = -1
    keys: tuple = ()
    shared: int = 0


class StateCheckpoints:
    """A rank's KDA state checkpoints, the prefix cache's budget: the free ones, and the cached blocks holding the
    others (`blocks`: the cache's own, shared). `evictable`: the blocks nobody holds that hold one, least recently
    let go first (the cache tells it: `let_go`, `held`), so a checkpoint needed where none is free is found without
    walking the blocks that hold none (most of them). A block holding one counts for its ancestors (`below`)."""

    def __init__(self, n: int, blocks: dict[bytes, Block]):
        self.free = list(range(n))
        self.blocks = blocks
        self.evictable: OrderedDict[bytes, Block] = OrderedDict()

    def let_go(self, block: Block) -> None:
        """Nobody holds `block` now."""
        if block.checkpoint >= 0:
            self.evictable[block.key] = block

    def held(self, key: bytes) -> None:
        """Block `key` is held again."""
        self.evictable.pop(key, None)

    def new(self) -> int:
        """A free checkpoint id, taken from the least recently used evictable block holding one where none is free
        (the block stays, without it); -1 where every checkpoint is held (the boundary is not checkpointed)."""
        if not self.free:
            victim = self._victim()
            if victim is None:
                return -1
            self.take_from(victim)
        return self.free.pop()

    def take_from(self, block: Block) -> None:
        """`block` (holding one) gives its checkpoint back: free again, no longer counted under its ancestors."""
        self.free.append(block.checkpoint)
        block.checkpoint = -1
        self.evictable.pop(block.key, None)
        self._count_below(block, -1)

    def _victim(self) -> Block | None:
        """Among the first VICTIMS_SCANNED evictable blocks holding a checkpoint (least recently used first), the first
        with a deeper checkpoint under it, else the first of all; None if no evictable block holds one."""
        first, seen = None, 0
        for block in self.evictable.values():
            if block.below:
                return block
            first, seen = first or block, seen + 1
            if seen == VICTIMS_SCANNED:
                break
        return first

    def _count_below(self, block: Block, change: int) -> None:
        """A checkpoint came to (change 1) or left (-1) `block`: its ancestors count it under them."""
        parent = self.blocks.get(block.parent)
        while parent is not None:
            parent.below += change
            parent = self.blocks.get(parent.parent)

    def offer(self, key: bytes, checkpoint: int) -> None:
        """The state after block `key` was saved in `checkpoint`: the block keeps it, unless it is not cached or has
        one already (then the checkpoint is free again)."""
        block = self.blocks.get(key)
        if block is None or block.checkpoint >= 0:
            self.free.append(checkpoint)
        else:
            block.checkpoint = checkpoint
            self._count_below(block, 1)
            if block.refs == 0:
                self.evictable[key] = block

    def held_at(self, key: bytes) -> bool:
        """Whether cached block `key` holds a checkpoint."""
        block = self.blocks.get(key)
        return block is not None and block.checkpoint >= 0

    def drop(self, checkpoint: int) -> None:
        """A checkpoint that was never saved (its iteration void or failed)."""
        self.free.append(checkpoint)


class PrefixCache:
    """One rank's cached blocks. page_size: P; sizes: as `prefix_sizes`; free_pages: the rank's free list, which
    evicted blocks' pages join."""

    def __init__(self, sizes: PrefixSizes, page_size: int, free_pages: list[int]):
        self.sizes, self.page_size, self.free_pages = sizes, page_size, free_pages
        self.blocks: dict[bytes, Block] = {}
        self.by_page: dict[int, Block] = {}
        self.evictable: OrderedDict[bytes, Block] = OrderedDict()  # blocks nobody holds, least recently used first
        self.checkpoints = StateCheckpoints(sizes.checkpoints, self.blocks)
        self.lookup_tokens = 0  # prompt tokens of admitted requests
        self.hit_tokens = 0  # of which taken from the cache

    # -- lookups ---------------------------------------------------------------------------------------------------
    def match(self, keys: list[bytes], ids: list[int]) -> Hit:
        """The deepest hit for a sequence of token ids whose full blocks' keys are `keys` (no reference taken)."""
        P, every = self.page_size, self.sizes.every
        limit = (len(ids) - 1) // P  # blocks that may be reused: one token at least is left to compute
        parent, best, shared = ROOT, Hit(), 0
        for i in range(min(limit, len(keys))):
            block = self.blocks.get(keys[i])
            if block is None or block.parent != parent or block.tokens != tuple(ids[i * P:(i + 1) * P]):
                break
            parent, shared = block.key, (i + 1) * P
            if block.checkpoint >= 0 and ((i + 1) * P) % every == 0:
                best = Hit((i + 1) * P, (), block.checkpoint, tuple(keys[:i + 1]))
        return Hit(best.tokens, tuple(self.blocks[k].page for k in best.keys), best.checkpoint, best.keys, shared)

    def reusable(self, hit: Hit) -> int:
        """How many of a hit's pages are evictable now (taking the hit makes them unavailable to others)."""
        return sum(k in self.evictable for k in hit.keys)

    def take(self, hit: Hit, prompt_tokens: int) -> None:
        """A request admitted with `hit` (of a prompt of `prompt_tokens`): it holds the hit's blocks."""
        for key in hit.keys:
            block = self.blocks[key]
            self._hold(block)
        self.lookup_tokens += prompt_tokens
        self.hit_tokens += min(hit.tokens, prompt_tokens)

    # -- what requests computed --------------------------------------------------------------------------------------
    def offer_page(self, key: bytes, parent: bytes, tokens, page: int) -> str:
        """A request's full page of block `key`, computed, the request holding the block's parent (or `parent` is
        ROOT): "cached" (the page is the block's now, the request holds it), "shared" (the block was cached by
        another request: the request holds it too, its page stays its own and goes back with it), or "refused"
        (another block has that key, or the parent is not cached: nothing is cached)."""
        block = self.blocks.get(key)
        if block is not None:
            if block.parent != parent or block.tokens != tuple(tokens):
                return "refused"
            self._hold(block)
            return "shared"
        if parent != ROOT and parent not in self.blocks:
            return "refused"
        block = Block(key, parent, tuple(tokens), page, refs=1)
        self.blocks[key] = block
        self.by_page[page] = block
        if parent != ROOT:
            self.blocks[parent].children += 1
        return "cached"

    def holds_page(self, page: int) -> bool:
        """Whether `page` is a cached block's."""
        return page in self.by_page

    # -- pages coming back -------------------------------------------------------------------------------------------
    def release(self, pages: list[int], shared: dict[int, bytes] | None = None) -> None:
        """A request lets go of its pages (and of the blocks it shares, `shared`: position -> key, where its own
        page holds what a cached block holds): cached blocks lose its reference (evictable once nobody holds them,
        the deepest first, so they are evicted first), its own pages are freed."""
        shared = shared or {}
        for i in reversed(range(len(pages))):
            if i in shared:
                self._let_go(self.blocks[shared[i]])
            block = self.by_page.get(pages[i])
            if block is None:
                self.free_pages.append(pages[i])
            else:
                self._let_go(block)

    def _hold(self, block: Block) -> None:
        block.refs += 1
        self.evictable.pop(block.key, None)
        self.checkpoints.held(block.key)

    def _let_go(self, block: Block) -> None:
        block.refs -= 1
        if block.refs == 0:
            self.evictable[block.key] = block
            self.checkpoints.let_go(block)

    def evict_one(self) -> bool:
        """Free the least recently used evictable leaf's page and checkpoint; False if none is evictable."""
        leaf = next((b for b in self.evictable.values() if b.children == 0), None)
        if leaf is None:
            return False
        self._evict(leaf)
        return True

    def _evict(self, block: Block) -> None:
        del self.blocks[block.key]
        del self.by_page[block.page]
        self.evictable.pop(block.key, None)
        self.free_pages.append(block.page)
        if block.checkpoint >= 0:
            self.checkpoints.take_from(block)
        parent = self.blocks.get(block.parent)
        if parent is not None:
            parent.children -= 1

    # -- what it holds -----------------------------------------------------------------------------------------------
    def usage(self) -> dict:
        held = self.sizes.checkpoints - len(self.checkpoints.free)
        return {"cached_pages": len(self.blocks), "checkpoints": held,
                "cached_bytes": len(self.blocks) * self.sizes.page_bytes + held * self.sizes.checkpoint_bytes,
                "lookup_tokens": self.lookup_tokens, "hit_tokens": self.hit_tokens}
