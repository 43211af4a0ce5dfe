"""Where ops sit in a traced program: nested equations and the dependencies between the
top-level equations of a jaxpr (the overlap tests check what runs between exchange halves)."""

from jax.extend.core import Var


def inner_eqns(eqn):
    """Every equation nested in eqn's sub-jaxprs (shard_map bodies, pjit, ...), recursively."""
    for param in eqn.params.values():
        for sub in param if isinstance(param, (tuple, list)) else (param,):
            jaxpr = getattr(sub, "jaxpr", sub)
            for inner in getattr(jaxpr, "eqns", ()):
                yield inner
                yield from inner_eqns(inner)


def holds(eqn, test):
    """Whether eqn or an equation nested in it passes `test`."""
    return test(eqn) or any(test(inner) for inner in inner_eqns(eqn))


def dependencies(jaxpr):
    """For each top-level equation, the indices of the top-level equations it depends on."""
    producer, deps = {}, []
    for i, eqn in enumerate(jaxpr.eqns):
        mine = set()
        for v in eqn.invars:
            if isinstance(v, Var) and v in producer:
                mine |= {producer[v]} | deps[producer[v]]
        deps.append(mine)
        for v in eqn.outvars:
            producer[v] = i
    return deps
