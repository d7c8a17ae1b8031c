#!/bin/bash
printf 'SECRET_KEY=change-me\nLOG_LEVEL=info\nWORKERS=4\nDATABASE_URL=sqlite:////app/data/app.db\n' > /app/deploy/app.env
