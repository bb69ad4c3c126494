"""End-to-end tier: opgate in front of a real etcd + kube-apiserver (see conftest.py)."""
