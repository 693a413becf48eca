"""Secure aggregation: a shard recovers only the sum of a round's pushes (Bonawitz et al. 2017).

Each pusher masks its quantised update with a self mask (seed Shamir-shared among the
shard's roster) and pairwise masks (X25519 key agreement) that cancel in the sum. The
shard relays the protocol's messages and unmasks the sum once the round's pushers are
known; see docs/PRIVACY.md for the threat model and limits.

- `ring`: fixed-point quantisation into Z_{2^bits} and the overflow bound
- `masks`: AES-256-CTR mask expansion
- `shamir`: t-of-n secret sharing of 32-byte seeds
- `keys`: X25519 key agreement, HKDF derivations, AES-GCM share encryption
- `settings`: what a job's ``ps.secure_aggregation`` resolves to
- `server`: the shard's state machine; `pusher`: the pushing worker's side
"""
