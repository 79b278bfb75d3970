"""How gradients travel beyond one allreduce: buckets filled during backward, the process group and its
links, and parameter servers."""
