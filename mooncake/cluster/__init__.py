"""The whole system on one machine: mooncake.cluster.launcher.LocalCluster (``mooncake up``)."""
