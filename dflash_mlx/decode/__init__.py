"""The decode loop: the decoder and its step (plan -> propose -> verify -> accept -> roll back),
each request's state, the planner and its costs, grammar masks, the prefix-cache policy, and
the proposals copied from the prompt and from earlier answers."""
