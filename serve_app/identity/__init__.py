"""Who is calling: API keys, identity tokens, teams, admins, and the guard on failed admin credentials."""
