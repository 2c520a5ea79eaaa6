"""The recovery engine: detection -> budget -> hook -> persist -> dispatch -> give-up (spine), against the
target the owning app registered (targets); the tick's claims (detection), alarms, the beat schedule,
and the dispatch of recovery work to a worker."""
