"""Steering a live job, training or serving alike: the interface both implement (`protocol`), the HTTP routes that
serve any implementation of it (`router`), bearer-token auth and key files (`auth`), and the metric conventions both
jobs publish under (`metrics`). Imports nothing of k3ray above config and policies, so serving never needs control/.
"""
