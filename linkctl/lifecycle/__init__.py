"""The pair's path as its owner walks it: `linkctl up` and `linkctl down` on each host.

up.py       the stages, in order: preflight (refuse before changing anything), the state
            as it was, link setup, calibration (when none for this build), the services
            (responder, the link unit's probe gate, serve; at boot too unless --no-boot),
            the peer (the gate passed), serving, and how to reach it
down.py     the same undone: services stopped and removed with what they wrote, the link
            torn down, the state directory put back as it was before up
record.py   what up keeps for down: the state directory as it was (UpRecord)
reach.py    what serves on this host and how to reach it (the URL, the key, a curl)
stage.py    one stage's record (name, changed, detail, seconds)

Every stage is a call into the package that owns it (net.link, calibrate, service,
probe's reports); nothing here runs a server or touches the network itself.
"""
