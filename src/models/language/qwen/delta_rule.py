"""The gated delta rule, Gated DeltaNet's recurrence: step by step, and chunked for training.

Per (batch, value head) a state S [d_k, d_v] is updated at each token t:

    S <- exp(g_t) * S                    decay (g_t <= 0)
    u_t = beta_t * (v_t - S^T k_t)       the error of S's prediction for v_t, scaled by beta_t
    S <- S + k_t u_t^T                   the delta rule's correction
    o_t = S^T q_t                        read after the update

q and k arrive L2-normalised (q also scaled by d_k^-0.5); each key head may serve several
value heads (H a multiple of H_k). Everything runs in fp32, since a low-precision state drifts
along the sequence; o comes back in v's dtype (as transformers returns it), so that the layers
after it see the model's own precision, and S stays fp32 for the next step. `starts` [B, T]
marks document starts in packed rows: there S restarts at zero, as if exp(g) were 0.
"""

import torch
import torch.nn.functional as F
from torch import Tensor


def recurrent_gated_delta_rule(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
    starts: Tensor | None = None, initial_state: Tensor | None = None,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """The recurrence one token at a time: the definition, and the decoding step.

    q, k [B, T, H_k, d_k]; v [B, T, H, d_v]; g, beta [B, T, H], where key head i serves value
    heads i*H/H_k ... (i+1)*H/H_k - 1 -> (o [B, T, H, d_v], final S [B, H, d_k, d_v]).
    """
    out_dtype = v.dtype
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    per_key_head = v.shape[2] // k.shape[2]
    q, k = q.repeat_interleave(per_key_head, 2), k.repeat_interleave(per_key_head, 2)
    batch, length, heads, key_dim = k.shape
    state = _initial_state(initial_state, (batch, heads, key_dim, v.shape[-1]), v.device)
    outputs = []
    for t in range(length):
        decay = g[:, t].exp()  # [B, H]
        if starts is not None:
            decay = decay.masked_fill(starts[:, t, None], 0.0)
        state = state * decay[..., None, None]
        prediction = torch.einsum("bhkv,bhk->bhv", state, k[:, t])
        update = beta[:, t, :, None] * (v[:, t] - prediction)  # [B, H, d_v]
        state = state + k[:, t, :, :, None] * update[:, :, None, :]
        outputs.append(torch.einsum("bhkv,bhk->bhv", state, q[:, t]))
    return torch.stack(outputs, dim=1).to(out_dtype), state


def chunk_gated_delta_rule(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
    starts: Tensor | None = None, initial_state: Tensor | None = None, chunk_size: int = 64,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """The same result as `recurrent_gated_delta_rule`, in blocks of `chunk_size` tokens.

    Inside a block the corrections u are found all at once by a triangular solve (the "UT
    transform" of DeltaNet), leaving one small matmul recurrence per block instead of per token.
    With gamma the cumulative log-decay inside the block and D[t, s] = exp(gamma_t - gamma_s) for
    s <= t (0 otherwise, and 0 across a document start):

        (I + strictly_lower(beta k k^T * D)) [U | W] = [beta v | beta k exp(gamma)]
        u = U - W S_0                                  corrections, given the incoming state
        o = (q exp(gamma)) S_0 + ((q k^T) * D) u       old state read, plus this block
        S = exp(gamma_last) S_0 + (k exp(gamma_last - gamma))^T u

    Terms reading S_0 are dropped for tokens after a document start inside the block, and the
    state update keeps only the block's last document. k k^T and q k^T are computed once per key
    head and shared by the value heads it serves.
    """
    batch, length, key_heads, key_dim = k.shape
    heads, value_dim = v.shape[2:]
    out_dtype = v.dtype
    size = chunk_size
    chunks = -(-length // size)

    def blocks(x: torch.Tensor, groups: int) -> torch.Tensor:
        """[B, T, H, ...] -> [B, groups, H / groups, N, C, ...], fp32, zero-padded to N*C tokens.

        beta = 0 and g = 0 make the padded tokens no-ops.
        """
        x = x.float().transpose(1, 2)
        x = F.pad(x, (0, 0) * (x.ndim - 3) + (0, chunks * size - length))
        return x.reshape(batch, groups, -1, chunks, size, *x.shape[3:])

    q, k = blocks(q, key_heads), blocks(k, key_heads)  # [B, H_k, 1, N, C, d_k]
    v = blocks(v, key_heads)  # [B, H_k, H / H_k, N, C, d_v]
    g, beta = blocks(g, key_heads), blocks(beta, key_heads)  # [B, H_k, H / H_k, N, C]
    tril = torch.ones(size, size, dtype=torch.bool, device=q.device).tril()
    connected = tril  # [.., C, C]: token s can reach token t inside the block
    gamma = g.cumsum(-1)
    if starts is not None:
        segment = blocks(starts[..., None], 1).cumsum(-1)  # documents begun in the block so far
        connected = tril & (segment[..., :, None] == segment[..., None, :])
        # The cumulative decay restarts with each document: summed over its own tokens only
        # (the others times an exact 0), so no document's result depends on another's values.
        gamma = (connected.to(g.dtype) @ g[..., None]).squeeze(-1)

    log_decay = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(~connected, -torch.inf)
    decay = _exp_decay(log_decay)  # D [.., N, C, C]
    state_decay = _exp_decay(gamma)  # exp(gamma_t) [.., N, C]
    to_last = gamma[..., -1:] - gamma  # log of exp(gamma_last - gamma_t)
    if starts is not None:
        state_decay = state_decay * (segment == 0)  # still the incoming state's document
        to_last = to_last.masked_fill(~connected[..., -1, :], -torch.inf)  # the last document
    to_last = _exp_decay(to_last)

    k_beta = k * beta[..., None]
    system = (k @ k.transpose(-1, -2)) * beta[..., None] * decay  # its strict lower part is read
    rhs = torch.cat((v * beta[..., None], k_beta * state_decay[..., None]), dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    new_values, keys_reading_state = solved.split((value_dim, key_dim), dim=-1)  # U, W
    block_attention = (q @ k.transpose(-1, -2)) * decay
    q_reading_state = q * state_decay[..., None]
    k_to_last = (k * to_last[..., None]).transpose(-1, -2)
    block_decay = state_decay[..., -1, None, None]  # exp(gamma_last), or 0 after a reset

    state = _initial_state(initial_state, (batch, heads, key_dim, value_dim), q.device)
    state = state.view(batch, key_heads, -1, key_dim, value_dim)
    incoming: list[torch.Tensor] = []
    corrections: list[torch.Tensor] = []
    for n in range(chunks):  # the only sequential part: one state update per block
        incoming.append(state)
        u = new_values[..., n, :, :] - keys_reading_state[..., n, :, :] @ state
        corrections.append(u)
        state = block_decay[..., n, :, :] * state + k_to_last[..., n, :, :] @ u
    states_in, block_corrections = torch.stack(incoming, dim=-3), torch.stack(corrections, dim=-3)
    out = q_reading_state @ states_in + block_attention @ block_corrections  # [.., N, C, d_v]
    out = out.reshape(batch, heads, chunks * size, value_dim)[:, :, :length]
    out = out.transpose(1, 2).to(out_dtype)
    return out, state.reshape(batch, heads, key_dim, value_dim)


def _exp_decay(log_decay: torch.Tensor) -> torch.Tensor:
    """exp(log_decay), with decays below exp(-30) ~ 1e-13 set to exactly 0.

    So small a decay changes no result by more than that fraction, but products with it fall
    into subnormal floats, which x86 CPUs compute tens of times more slowly.
    """
    return log_decay.masked_fill(log_decay < -30, -torch.inf).exp()


def _initial_state(state: torch.Tensor | None, shape: tuple[int, ...], device) -> torch.Tensor:
    return torch.zeros(shape, device=device) if state is None else state.float()
