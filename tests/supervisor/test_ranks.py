"""The rank actors' mechanism (`supervisor.ranks`) where it needs no Ray: the spare pool takes
a named spare, else one off the shunned nodes, keeps local spares apart, and forgets them all
at once; actor names are the ones a restarted supervisor looks for."""

from __future__ import annotations

from remedy.supervisor.ranks import Spares, rank_name, spare_name


def _pool() -> Spares:
    pool = Spares()
    pool.add("s1", "spare-1", "node-a")
    pool.add("s2", "spare-2", "node-b", local=True)
    pool.add("s3", "spare-3", "node-c")
    return pool


def test_a_spare_off_the_shunned_nodes_is_taken_first_else_the_first() -> None:
    pool = _pool()
    assert pool.take(shun={"node-a"}) == ("s2", "spare-2")
    assert pool.local == set() and pool.names == ["spare-1", "spare-3"]
    assert pool.take(shun={"node-a", "node-c"}) == ("s1", "spare-1")  # none off them: the first
    assert pool.take(name="spare-3") == ("s3", "spare-3") and not pool.nodes


def test_local_spares_are_found_by_node_and_counted_apart() -> None:
    pool = _pool()
    assert pool.local_on("node-b", any_node=False) == "spare-2"
    assert pool.local_on("node-a", any_node=False) is None
    assert pool.local_on(None, any_node=True) == "spare-2"  # one node: any local spare
    assert pool.apart == 2 and pool.kept_on("node-b") == 1 and pool.kept_on(None) == 1
    assert pool.on_node("node-c") == ["spare-3"]
    assert pool.clear() == ["s1", "s2", "s3"] and pool.apart == 0 and not pool.names


def test_actor_names_carry_the_run_the_rank_and_its_incarnation() -> None:
    assert rank_name("r1", 3, 2) == "remedy-rank-r1-3-i2"
    assert spare_name("r1", 7) == "remedy-spare-r1-7"
