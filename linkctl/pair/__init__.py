"""`linkctl pair`: two hosts on one cable find each other over IPv6 link-local, agree
on a profile (subnet, addresses, roles, MTU), confirm it with a code both screens show,
write it on both, then set the link up and probe it.

announce   what one host says about itself (typed, bounded: the peer is untrusted)
iface      which interface is the cable (never the default route's, never WiFi)
wire       the link-local UDP channel: messages in, messages out, nothing routed
agree      both announcements -> one profile, the same on both hosts, or a refusal
run        the stages, in order, with progress
"""
