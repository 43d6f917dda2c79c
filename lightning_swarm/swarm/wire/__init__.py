"""What crosses the wire between peers, bottom up: the 8-bit kernel (``quantize``) -> ``codec`` (a tensor <-> parts)
-> ``payload`` (structures <-> skeleton + tensors) -> ``protocol`` (requests, replies, validation) and ``errors`` ->
``transport`` (one request to one peer), with ``guards`` on the values and the same-host paths (``same_host``,
``same_host_sum``). Nothing here knows of stages, the DHT or optimizers."""
