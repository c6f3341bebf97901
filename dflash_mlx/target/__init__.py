"""The target model behind the loop: its wrapper (features, fused ops), its caches and their
rollback per cache kind, GatedDeltaNet's tape, and everything read of mlx-lm beyond its
public API (mlx_lm_compat.py)."""
