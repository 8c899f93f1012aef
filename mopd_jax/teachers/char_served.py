"""Teachers behind servers read for the `char_kl` targets (`char_marginal.targets`): their
top-k next-token distributions, and the step's eq. 15 scores from the same request.

A step asks the servers once for its batch: `Served.submit` sends each row with one token
more through its family's top-k client, and the answer gives both the log-probs of the rows'
own tokens (eq. 15's scores, `fetch`) and the top-k after every position, which
`next_logprobs` reads back when the targets ask for the same rows; only the branches
(`char_marginal._score_branches`) are new requests.
"""
from __future__ import annotations

import dataclasses

import numpy as np

# Answers kept per client for `next_logprobs`: the step being trained and, with
# `mopd.staleness` 1, the next one, submitted before it.
_KEPT = 2


class _Asked:
  """One client's request in flight: its rows, their live tokens, the pending answer."""

  def __init__(self, rows, live, pending):
    self.rows, self.live, self.pending, self.got = rows, live, pending, None

  def answer(self, client):
    if self.got is None:
      self.got = client.fetch(self.pending)
    return self.got

  def same(self, rows, live) -> bool:
    return (self.rows.shape == rows.shape and np.array_equal(self.rows, rows) and
            np.array_equal(self.live, live))


class _Submitted:
  """`Served.submit`'s handle: the batch's mask, each client's request."""

  def __init__(self, mask, asked):
    self.mask, self.asked = mask, asked  # asked: [(client, where [(k, kk)], _Asked)]

  def block_until_ready(self):
    for _, _, a in self.asked:
      a.pending.block_until_ready()
    return self


@dataclasses.dataclass(frozen=True)
class Served:
  """Teachers behind servers, read for the next-character targets: a row's next-token
  distribution after a position is the servers' top-k there and the row's own next token
  (whose log-prob every answer carries), the mass left over spread evenly over the other
  tokens (the least-informative completion: no character any token writes is given
  probability 0, so the reverse KL stays bounded); with k the teacher's vocabulary it is the
  in-process pass. Each row is sent with one token more (`filler`), so the distribution
  after its last token is read too (a prompt's log-probs stop at its last token). `bank`:
  the run's bank without params (a `families.MixedBank` of several families); `clients`:
  ((cells, a `teacher_client.EndpointScorer` of those cells built with `top_k` > 0), ...),
  one per family; `cells`: the teachers of the K axis this view reads (None: all of them,
  router order), one family's. `kept`: the answers of `submit` not yet read back, per
  client (shared by every view of one `Served`)."""
  bank: object
  clients: tuple
  cells: tuple = None
  filler: int = 0
  kept: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

  @property
  def router(self):
    return self.bank.router

  @property
  def names(self) -> tuple:
    return tuple(self.cells or self.bank.router.names)

  def family(self, cells) -> "Served":
    return dataclasses.replace(self, cells=tuple(cells))

  def close(self) -> None:
    for _, client in self.clients:
      client.close()

  def _rows(self, client, tokens, lengths) -> tuple:
    """(rows [client's cells, n, T + 1] each with its filler, their live tokens, where:
    [(k of this view's K axis, kk of the client's)]) for the view's cells the client
    serves."""
    _, n, width = tokens.shape
    every = list(client.names)
    rows = np.zeros((len(every), n, width + 1), np.int32)
    live = np.zeros((len(every), n, width + 1), bool)
    where = [(k, every.index(c)) for k, c in enumerate(self.names) if c in every]
    for k, kk in where:
      rows[kk, :, :width] = tokens[k]
      for j in range(n):
        if lengths[k, j]:
          rows[kk, j, lengths[k, j]] = self.filler
          live[kk, j, :lengths[k, j] + 1] = True
    return rows, live, where

  def submit(self, tokens_KxnxT, input_mask_KxnxT) -> _Submitted:
    """Eq. 15's scoring of a stratified batch (the scorer's `submit`), sent as the targets'
    own request: every family's rows through its top-k client, the answers kept for
    `next_logprobs`."""
    tokens, mask = np.asarray(tokens_KxnxT), np.asarray(input_mask_KxnxT, bool)
    lengths, asked = mask.sum(-1), []
    for _, client in self.clients:
      rows, live, where = self._rows(client, tokens, lengths)
      if not where:
        continue
      a = _Asked(rows, live, client.submit(rows, live))
      kept = self.kept.setdefault(id(client), [])
      kept[:] = (kept + [a])[-_KEPT:]
      asked.append((client, where, a))
    return _Submitted(mask, asked)

  def fetch(self, submitted: _Submitted) -> np.ndarray:
    """[K, n, T] the log-prob of each row's token t after its tokens before t (0 at the
    first and past the row), as the scorer's `fetch` gives eq. 15."""
    mask = submitted.mask
    out = np.zeros(mask.shape, np.float32)
    for client, where, a in submitted.asked:
      lp = np.asarray(a.answer(client)[0])
      for k, kk in where:
        out[k] = np.where(mask[k], lp[kk, :, :mask.shape[-1]], 0.0)
    return out

  def _answer(self, client, rows, live):
    """The servers' answer to `rows`: one `submit` kept (then forgotten), else asked now."""
    kept = self.kept.get(id(client), [])
    for i, a in enumerate(kept):
      if a.same(rows, live):
        del kept[i]
        return a.answer(client)
    return client.fetch(client.submit(rows, live))

  def next_logprobs(self, tokens, *, mask_KxnxT, at_KxnxA):
    tokens, mask, at = np.asarray(tokens), np.asarray(mask_KxnxT, bool), np.asarray(at_KxnxA)
    client = next(c for cells, c in self.clients if set(self.names) <= set(cells))
    k_n, n, _ = tokens.shape
    rows, live, where = self._rows(client, tokens, mask.sum(-1))
    lp, tk_lp, tk_ids = (np.asarray(x) for x in self._answer(client, rows, live))
    fams = getattr(self.bank, "families", None)  # a MixedBank: the view's family's model
    cfg = (next(f.model_cfg for f in fams if set(self.names) <= set(f.cells)) if fams
           else self.bank.model_cfg)
    vocab = max(cfg.vocab_size, int(np.max(tk_ids, initial=0)) + 1)
    out = np.full((k_n, n, at.shape[-1], vocab), -np.inf, np.float32)
    j, a = np.arange(n)[:, None], np.arange(at.shape[-1])[None, :]
    for k, kk in where:
      pos = at[k] + 1  # the answer at position t is the distribution that predicts token t
      known = np.zeros(out.shape[1:], bool)
      out[k][j[..., None], a[..., None], tk_ids[kk][j, pos]] = tk_lp[kk][j, pos]
      known[j[..., None], a[..., None], tk_ids[kk][j, pos]] = True
      out[k][j, a, rows[kk][j, pos]] = lp[kk][j, pos]
      known[j, a, rows[kk][j, pos]] = True
      # The mass past what was read, spread evenly over the tokens not read.
      rest = np.maximum(1.0 - np.exp(np.where(known, out[k], -np.inf)).sum(-1), 0.0)
      with np.errstate(divide="ignore"):
        fill = np.log(rest / np.maximum((~known).sum(-1), 1)).astype(np.float32)
      out[k] = np.where(known, out[k], fill[..., None])
    return out
