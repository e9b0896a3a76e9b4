"""A test cluster of network-namespace hosts with sshd on this one machine (see netns_cluster.py)."""
