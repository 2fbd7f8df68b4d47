"""tiles: spatial tiling of conv/pool/BN layers: regions, halos, fused tile stacks (imports torch, numpy; never swarm or trio)."""
