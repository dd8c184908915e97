"""The Manager every engine shares (base.py: lifecycle, topology, the collective and training API over an
engine and a strategy) and the rendezvous stores two engines use (stores.py). Each engine's own Manager lives in
its package under unidist/engines/."""
