"""The admin API's operations (keys, teams, admins, usage, audit), served by serve_app/http."""
