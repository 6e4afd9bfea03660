"""Model arithmetic both sides read: the model's shape and FLOPs, its sharding over the mesh, its memory fit."""
