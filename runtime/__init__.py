"""What runs on the ranks: process groups, sharded parameters, collectives, schedules.

Not built yet: the runtime issue delivers lowering and ``autopar.parallelize``.
"""
