"""Groups on the ``kubernetes`` runtime: each group's pool ``<tier>.<group>`` is one Deployment,
found by its labels, made from a copy of its tier's when the group names a runtime and none
exists, its image set when the runtime's changes (``clone.py`` decides; this writes). The image
is only ever the one the commander's ``group_runtimes`` give for the group's runtime name
(``commander.group_runtimes``): a group naming a runtime the commander does not allow, or one
without an image, is rejected and nothing is created or patched.

The runtime's ``check_group(pool)``, which the commander asks every pass for every group's
pool, and ``refusal(pool)``, which it asks before acting, both bring the pool's Deployment in
line with the group (``GroupDeployments.check``): so a new group gets its Deployment (at 0
replicas) as soon as the policy names it, and an image edit rolls the pool out at the next
pass. A created Deployment is noted (``deployment-created``), an image set too (``rollout``:
the Deployment replaces its pods with the new image by its own strategy). A group that can have
no Deployment here (none labelled for it and no runtime; a Deployment named by the group but
labelled for another pool; several) is rejected with the reason; so is one whose write failed,
while ``Writes`` holds the pool's writes off, after which it is tried again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

import redis

from commander.group_runtimes import GroupRuntime, resolve
from commander.runtime.interface import RuntimeNote
from commander.runtime.kubernetes.api import API_ERRORS, ApiException, KubeApi, describe
from commander.runtime.kubernetes.clone import (
    GroupAction,
    budget_for,
    clone_for_group,
    group_action,
    image_patch,
)
from commander.runtime.kubernetes.listing import Listing
from commander.runtime.kubernetes.model import Deployment, deployment_of
from commander.runtime.kubernetes.writes import Writes
from protocol.groups import Group, split_pool
from stores.policies import read_policy
from stores.retry import TRANSIENT

log = logging.getLogger(__name__)


class GroupDeployments:
    """Brings each group's Deployment in line with its group; deletes the ones it made once
    their group is gone. What it did goes to ``note``, for the ledger."""

    def __init__(self, api: KubeApi, listing: Listing, writes: Writes, r: redis.Redis,
                 note: Callable[[RuntimeNote], None], runtimes: Mapping[str, GroupRuntime]) -> None:
        """``runtimes``: the group runtimes the commander allows (where a group's image comes from)."""
        self.api, self.listing, self.writes, self.r, self.note = api, listing, writes, r, note
        self.runtimes = runtimes

    def check(self, pool: str) -> str | None:
        """Bring the pool's Deployment in line with its group (create it, set its image); why it
        cannot be, or None. None too for a tier's own pool, a pool no group names any more, and
        while the Deployments or the policy cannot be read (``refusal`` says so, or nothing)."""
        tier, name = split_pool(pool)
        group = self._group(tier, name) if name else None
        deployments = self.listing.deployments
        if group is None or deployments is None:
            return None
        image, why = resolve(self.runtimes, tier, group, "image")
        if why is not None:
            return why
        why = self.writes.held(pool)
        if why is not None:
            return why
        action = group_action(pool, group.deployment, image, deployments, self.api.namespace)
        if action.kind == "refuse":
            return action.why
        if action.kind == "ok":
            return None
        assert image is not None  # (group_action creates or sets an image only when given one)
        try:
            self._write(pool, action, group, image)
        except API_ERRORS:
            return self.writes.held(pool)
        return None

    def forgotten(self, pool: str) -> None:
        """Delete the Deployment this runtime made for a group now gone from its policy (its
        ``copied-from`` annotation says so), and its budget, once it has no replica and no pod:
        a ``deployment-deleted`` note. A Deployment of yours (no annotation) stays, as does one
        still running pods; a delete that fails is noted, not retried (delete it by hand)."""
        self.listing.refresh(force=True)
        for d in [d for d in self.listing.deployments or () if d.tier == pool]:
            pods = [p.name for p in self.listing.pods if p.tier == pool]
            if not d.copied_from or d.replicas or pods:
                why = "not made by Fleet" if not d.copied_from else f"{d.replicas} replicas, pods {pods}"
                log.info("pool %s is gone from its tier's policy; Deployment %s stays: %s", pool, d.name, why)
                continue
            try:
                self.api.delete_deployment(d.name)
                self.api.delete_budget(d.name)
            except API_ERRORS as exc:
                self.note(RuntimeNote(pool, "deployment-kept", (
                    f"Deployment {d.name}, made for a group now gone from the policy, could not be deleted "
                    f"({describe(exc)}): delete it and its PodDisruptionBudget by hand")))
                continue
            self.listing.drop_deployment(d.name)
            note = RuntimeNote(pool, "deployment-deleted", (
                f"Deployment {d.name} and its PodDisruptionBudget deleted: made for group "
                f"{split_pool(pool)[1]}, which its tier's policy no longer names, and running no pod"))
            log.info("pool %s: %s", pool, note.reason)
            self.note(note)

    def _group(self, tier: str, name: str) -> Group | None:
        try:
            policy = read_policy(self.r, tier).policy
        except TRANSIENT as exc:
            log.debug("policy of %s not readable: its groups' Deployments wait (%s)", tier, exc)
            return None
        return next((g for g in policy.rollout.groups if g.name == name), None)

    def _write(self, pool: str, action: GroupAction, group: Group, image: str) -> None:
        assert action.deployment is not None  # (group_action's promise)
        if action.kind == "create":
            made, budget = self._create(pool, action.deployment, action.name, image)
            note = RuntimeNote(pool, "deployment-created", (
                f"Deployment {made.name} created for group {group.name} of tier {split_pool(pool)[0]}: "
                f"a copy of {action.deployment.name} with image {image} (runtime {group.runtime}), "
                f"0 replicas; {budget}"))
        else:
            made = self._set_image(action.deployment, image)
            note = RuntimeNote(pool, "rollout", (
                f"Deployment {made.name}: image {action.deployment.image or '(none)'} -> {image}: "
                f"a rollout of pool {pool} (its Deployment replaces its pods by its own strategy)"))
        self.listing.put_deployment(made)
        log.info("pool %s: %s", pool, note.reason)
        self.note(note)

    def _create(self, pool: str, source: Deployment, name: str, image: str) -> tuple[Deployment, str]:
        """The group's Deployment, made; and what became of its PodDisruptionBudget (a budget
        that cannot be made, a Role without the verb say, is reported, not a reason to refuse)."""
        with self.writes.writing(Deployment(name, pool, 0)):
            body = clone_for_group(self.api.deployment(source.name), pool, image, name)
            try:
                made = self.api.create_deployment(body)
            except ApiException as exc:
                if exc.status != 409:  # 409: it exists already (a listing behind the write)
                    raise
                made = deployment_of(self.api.deployment(name))
            if made is None or made.tier != pool:
                raise ValueError(f"Deployment {name} is not labelled for pool {pool}")
        try:
            self.api.create_budget(budget_for(body))
        except API_ERRORS as exc:
            log.warning("pool %s: no PodDisruptionBudget for Deployment %s: %s", pool, name, exc)
            why = describe(exc)
            return made, f"no PodDisruptionBudget ({why}): a node drain may evict all its pods at once"
        return made, f"PodDisruptionBudget {name} (maxUnavailable 1)"

    def _set_image(self, deployment: Deployment, image: str) -> Deployment:
        with self.writes.writing(deployment):
            ops = image_patch(self.api.deployment(deployment.name), image)
            made = self.api.set_image(deployment.name, ops)
            if made is None or made.tier != deployment.tier:
                raise ValueError(f"Deployment {deployment.name} is labelled for another pool now")
            return made
