"""What runs a request on the device: padding buckets and the compile registry (programs), what a request is
(requests), token sampling (sampling), and target-only generation (decode)."""
